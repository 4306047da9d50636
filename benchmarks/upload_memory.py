"""What ``pack --upload``'s transfer itself holds in memory (issue 43): one shard-sized file sent through
``upload.live.LiveUpload`` (huggingface_hub's LFS PUT, as the pack sends each shard) to the fake Hub's sink, in a
child process whose anonymous memory (RssAnon) is sampled every 0.1 s: before, the peak during, after.

    python benchmarks/upload_memory.py [--gb 4] [--dir DIR]

The file is written once (real blocks of zeros, not a hole: the read is the disk's); its sha256 is computed here
and given to the upload, as the pack gives the journal's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CHILD = r"""
import os, sys, threading, time
from pathlib import Path
from kimi_convert.upload.live import LiveUpload, UploadTarget
from rss_sample import rss
def anon():
    return rss(os.getpid(), "RssAnon")
f, sha = Path(sys.argv[1]), sys.argv[2]
up = LiveUpload(UploadTarget("user/upload-memory", token=os.environ["HF_TOKEN"], keep_output=True), say=print)
peak, done = [0], threading.Event()
def sample():
    while not done.wait(0.1):
        peak[0] = max(peak[0], anon())
time.sleep(0.5)
base = peak[0] = anon()
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
up.start(f.parent, lambda *a: None)
up.admit(False, threading.Event())
up.submit(f.name, f.stat().st_size, sha)
up.close()
done.set()
print(f"RssAnon before {base / 1e6:.1f} MB, peak during {peak[0] / 1e6:.1f} MB, after {anon() / 1e6:.1f} MB; "
      f"{f.stat().st_size / 1e9:.2f} GB sent in {time.perf_counter() - t:.1f} s")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kimi-convert-upload-memory"))
    a = ap.parse_args()
    from fakehub import TOKEN, FakeHub

    a.dir.mkdir(parents=True, exist_ok=True)
    f = a.dir / "model-00001-of-00001.safetensors"
    size = int(a.gb * 1e9) // (16 << 20) * (16 << 20)
    if not f.is_file() or f.stat().st_size != size:
        with open(f, "wb") as out:
            for _ in range(size // (16 << 20)):
                out.write(bytes(16 << 20))
    h = hashlib.sha256()
    with open(f, "rb") as src:
        while block := src.read(16 << 20):
            h.update(block)
    with FakeHub(TOKEN, keep_uploads=False) as hub:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
        env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   TQDM_DISABLE="1", HF_HOME=str(a.dir / "hf-home"), PYTHONPATH=str(Path(__file__).parent))
        subprocess.run([sys.executable, "-c", CHILD, str(f), h.hexdigest()], env=env, check=True)


if __name__ == "__main__":
    main()
