"""``pack`` of a banked plan holds one wave's part of the plan at a time (issue 43, ``convert/jobs.py``): the
module-by-module plan is never made whole, each wave's shards are expanded from the outline when the wave starts,
and the output is the same bytes whatever the waves (a shard a wave, or all at once), killed and resumed, or sent
to the Hub as each shard is final.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

from test_pack_upload import assert_same_repo

from fakehub import TOKEN, FakeHub, hub_cli
from helpers import ONE_STREAM, blake3_hex, run_process, tree


def test_a_shard_a_wave_is_the_same_bytes_and_never_makes_the_whole_plan(banked_k3, tmp_path, monkeypatch):
    from kimi_convert.options import Options
    from kimi_convert.pack import pack
    from kimi_convert.plan import Plan
    from kimi_convert.tuning import Tuning

    src, ref = banked_k3
    asked: list[set[str]] = []
    parts_of = Plan.parts_of

    def spy(self, files):
        asked.append(set(files))
        return parts_of(self, files)

    monkeypatch.setattr(Plan, "parts_of", spy)
    r = pack(src, tmp_path / "out", Options(), device="cpu", workers=1, streams=1, progress=False,
             tuning=Tuning(wave_units=1))
    assert tree(tmp_path / "out") == tree(ref)
    shards = sorted(p.name for p in ref.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(f for a in asked for f in a) == shards and all(len(a) == 1 for a in asked)
    assert r.plan.expansion is not None and "_modules" not in r.plan.__dict__  # the whole plan never made
    assert (r.stats.workers, r.stats.streams) == (1, 1)  # a stream at once, whatever the waves


def test_waves_follow_the_units_and_the_slots():
    from kimi_convert.jobs import cut_waves, hash_owners
    from kimi_convert.plan import ShardLoad, ShardSize

    todo = [ShardSize(f"s{i}", 10, 1) for i in range(5)]
    loads = {s.file: ShardLoad(u, {f"i{k}": 5 * k for k in range(3)} if s.file == "s3" else {"i0": 1})
             for s, u in zip(todo, [3, 3, 3, 1, 9], strict=True)}
    assert [[s.file for s in w] for w in cut_waves(todo, loads, 1, 6)] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert [[s.file for s in w] for w in cut_waves(todo, loads, 2, 1)] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert cut_waves([], loads, 2, 1) == [[]]  # nothing to write: one wave, whose jobs hash the inputs
    waves = cut_waves(todo, loads, 1, 6)
    assert hash_owners(["i0", "i1", "i2", "i9"], waves, loads) == [{"i0", "i9"}, {"i1", "i2"}, set()]


def test_killed_between_waves_resumes_identically(banked_k3, tmp_path):
    src, ref = banked_k3
    out = tmp_path / "out"
    env = {"KIMI_CONVERT_WAVE_UNITS": "1"}
    r = run_process("pack", src, out, *ONE_STREAM, env={**env, "KIMI_CONVERT_FAULT": "shard:2"})
    assert r.code == -signal.SIGKILL, (r.code, r.stderr)
    assert not (out / "manifest.json").exists()
    r = run_process("pack", src, out, *ONE_STREAM, "--resume", env=env)
    assert r.code == 0, r.stderr
    assert tree(out) == tree(ref)


def test_a_resume_does_not_hash_again_the_inputs_a_wave_hashed_whole(banked_k3, tmp_path):
    """Each wave's input files' digests are journaled when the wave ends; a resume takes them from the journal and
    hashes only the others (the released K3 killed after 86 of its 96 shards re-read 1.4 TB for them: issue 43's
    kill leg), and writes the same manifest."""
    import json

    src, ref = banked_k3
    out, stats = tmp_path / "out", tmp_path / "stats.json"
    env = {"KIMI_CONVERT_WAVE_UNITS": "1"}
    r = run_process("pack", src, out, *ONE_STREAM, env={**env, "KIMI_CONVERT_FAULT": "shard:3"})
    assert r.code == -signal.SIGKILL, (r.code, r.stderr)
    known = json.loads((out / ".kimi-convert-pack.json").read_text())["input_digests"]
    assert known and all("blake3:" + blake3_hex((src / f).read_bytes()) == h for f, h in known.items())
    r = run_process("pack", src, out, *ONE_STREAM, "--resume", "--stats", stats, env=env)
    assert r.code == 0, r.stderr
    assert tree(out) == tree(ref)
    st = json.loads(stats.read_text())
    rest = sum(p.stat().st_size for p in src.glob("*.safetensors") if p.name not in known)
    assert st["hashed_from_pipeline"] + st["hash_reread"] == rest < sum(
        p.stat().st_size for p in src.glob("*.safetensors"))


def test_upload_by_waves_equals_pack_then_upload(banked_k3, tmp_path):
    src, ref = banked_k3
    ref = Path(shutil.copytree(ref, tmp_path / "ref"))  # (upload writes its card into the folder)
    with FakeHub(TOKEN) as hub:
        r = hub_cli(hub, "upload", ref, "user/ref", tmp=tmp_path)
        assert r.code == 0, r.stderr
        files = {p: hub.file_bytes("user/ref", p) for p in hub.repos["user/ref"].files}
        lfs = sorted(f["lfs"] for f in hub.repos["user/ref"].files.values() if f["lfs"])
        r = hub_cli(hub, "pack", src, tmp_path / "out", "--upload", "user/waves", "--no-keep-output", *ONE_STREAM,
                    tmp=tmp_path, KIMI_CONVERT_WAVE_UNITS="1", KIMI_CONVERT_UPLOAD_QUEUE="0")
        assert r.code == 0, r.stderr
        assert_same_repo(hub, "user/waves", {"files": files, "lfs": lfs})
