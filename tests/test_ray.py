"""``pack --ray`` on a local Ray cluster: the same bytes as a plain pack, also with a task's worker
process killed mid-way and with a node lost mid-way (Ray re-runs the task); Ray missing or the
cluster unreachable: one line.

The cluster (``ray.cluster_utils.Cluster``, processes of this machine): a head that runs no task
(the driver attaches to it) and two nodes of one CPU each, so two tasks run at once, one a node.
Each pack is a real ``kimi-convert`` process (the Ray driver), run from the test's folder with
relative paths (the tasks run elsewhere: they must be given absolute ones).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fault_inject
from helpers import (
    Result,
    child,
    local_ray_cluster,
    needs_ray,
    one_line_error,
    run_process,
    running_tasks,
    wait_ray_tasks_end,
)
from kimi_convert.pack import pack
from kimi_convert.plan import Options

ROOT = Path(__file__).parents[1]


# 34 shards of at most 300 KB (SGLang's fused layout)
PACK_ARGS = ["--layout", "sglang", "--recipe", "nvfp4-w4a16", "--max-shard-size", "300KB", "--device", "cpu", "-q"]


def cli(*args, cwd: Path, env: dict | None = None, timeout: float = 300) -> Result:
    return run_process(*args, env=env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def ref(tiny_k3, tmp_path_factory) -> Path:
    """A plain pack (one machine, one process) of tiny-k3."""
    out = tmp_path_factory.mktemp("ray") / "ref"
    pack(tiny_k3, out, Options(max_shard_size=300_000, recipe="nvfp4-w4a16", layout="sglang"), device="cpu",
         progress=False)
    assert len(list(out.glob("*.safetensors"))) >= 8
    return out


@pytest.fixture(scope="module")
def cluster():
    # node failures noticed within about 3 s (Ray's default: about 30 s)
    with local_ray_cluster({"health_check_period_ms": 1000, "health_check_failure_threshold": 3}) as c:
        yield c


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def resubmitted(cluster, driver: int) -> int:
    """How many times the Ray driver ``driver`` (a pack) re-submitted one of its tasks, from its own log
    in the cluster's session folder (ray==2.60's wording)."""
    logs = list(Path(cluster.head_node.get_logs_dir_path()).glob(f"python-core-driver-*_{driver}.log"))
    assert len(logs) == 1, logs
    return sum("Will resubmit task" in line and "task_name=kimi-convert model-" in line
               for line in logs[0].read_text(errors="replace").splitlines())


def relative(path: Path, cwd: Path) -> str:
    return os.path.relpath(path, cwd)


@needs_ray
@pytest.mark.slow
def test_ray_pack_equals_plain_pack(tiny_k3, ref, cluster, tmp_path):
    t = time.monotonic()
    r = cli("pack", relative(tiny_k3, tmp_path), "out", *PACK_ARGS, "--ray", cluster.address, cwd=tmp_path)
    assert r.code == 0, r.stderr
    assert "34 shards" in r.stdout
    assert fault_inject.same_tree(ref, tmp_path / "out") == []  # every file, the manifest too; no journal left
    print(f"pack --ray: {time.monotonic() - t:.1f} s")


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize(("point", "at"), [("shard", 2), ("tensor", 30)])
def test_worker_killed_mid_way_is_retried(tiny_k3, ref, cluster, tmp_path, point, at):
    """The first task process to reach the point SIGKILLs itself (after renaming its 2nd shard, not yet
    reported; or mid-write of a tensor, a .partial left); Ray re-runs its task on a new worker."""
    marker = tmp_path / "killed"
    with child([sys.executable, "-m", "kimi_convert.cli", "pack", relative(tiny_k3, tmp_path), "out", *PACK_ARGS,
                "--ray", cluster.address], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
               env={**os.environ, "KIMI_CONVERT_FAULT": f"{point}:{at}", "KIMI_CONVERT_FAULT_ONCE": str(marker)}) as p:
        _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert marker.exists(), "no task reached the fault point"
    assert not alive(int(marker.read_text()))  # that Ray worker is gone
    assert resubmitted(cluster, p.pid) == 1  # Ray's own log: it re-ran one task
    assert fault_inject.same_tree(ref, tmp_path / "out") == []


def test_ray_missing_is_one_line(tiny_k3, tmp_path):
    blocked = ("import sys; sys.modules['ray'] = None; from kimi_convert.cli import main; "
               "sys.argv[0] = 'kimi-convert'; main()")
    p = subprocess.run([sys.executable, "-c", blocked, "pack", str(tiny_k3), str(tmp_path / "out"), "--ray"],
                       capture_output=True, text=True, timeout=120)
    r = Result(p.returncode, p.stdout, p.stderr)
    assert "pip install 'kimi-convert[ray]'" in one_line_error(r)
    assert not (tmp_path / "out").exists()  # refused before any work
    r = cli("pack", tiny_k3, tmp_path / "out", "--ray", "--workers", "2", cwd=tmp_path)
    assert "--workers does not apply with --ray" in one_line_error(r)


@needs_ray
def test_unreachable_cluster_is_one_line(tiny_k3, tmp_path):
    # nothing listens on port 1: refused at once (Ray's own client would retry for minutes)
    r = cli("pack", tiny_k3, tmp_path / "out", "--ray", "127.0.0.1:1", cwd=tmp_path, timeout=60)
    assert "--ray 127.0.0.1:1: cannot reach the Ray cluster" in one_line_error(r)
    r = cli("pack", tiny_k3, tmp_path / "out", "--ray", "not-an-address", cwd=tmp_path, timeout=60)
    assert "cannot reach the Ray cluster" in one_line_error(r)
    assert not (tmp_path / "out").exists()


@needs_ray
@pytest.mark.slow
def test_driver_killed_then_resumed(tiny_k3, ref, cluster, tmp_path):
    """The driver journals each shard as its record arrives: killed mid-way (its tasks stop with it),
    ``--resume`` with ``--ray`` keeps what the journal holds and finishes byte-identically."""
    from kimi_convert.journal import Journal

    marker = tmp_path / "paused"
    args = [sys.executable, "-m", "kimi_convert.cli", "pack", relative(tiny_k3, tmp_path), "out", *PACK_ARGS,
            "--ray", cluster.address]
    with child(args, cwd=tmp_path, stderr=subprocess.PIPE, text=True,
               env={**os.environ, "KIMI_CONVERT_FAULT": "shard:2:pause", "KIMI_CONVERT_FAULT_ONCE": str(marker)}) as p:
        wait_for(marker, p)
        time.sleep(2)  # the paused task's first shard reaches the journal
        assert int(marker.read_text()) in running_tasks(cluster)
        p.kill()
        p.wait()
    deadline = time.monotonic() + 60
    wait_ray_tasks_end(cluster, timeout=60)  # Ray stops the tasks of a driver that is gone
    while alive(int(marker.read_text())):  # and then the paused task's worker process (seconds under load)
        assert time.monotonic() < deadline, "the paused task's worker outlived its driver"
        time.sleep(0.2)
    journal = Journal.load(tmp_path / "out")
    assert journal is not None and journal.shards
    r = cli(*args[3:], "--resume", cwd=tmp_path)
    assert r.code == 0, r.stderr
    assert f"({len(journal.shards)} finished shard(s) verified and kept)" in r.stdout
    assert fault_inject.same_tree(ref, tmp_path / "out") == []


def wait_for(marker: Path, p: subprocess.Popen) -> int:
    """The pid a fault point wrote into ``marker`` (it paused there), while pack ``p`` runs."""
    deadline = time.monotonic() + 240
    while not (marker.exists() and marker.read_text()):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "no task reached the fault point"
        time.sleep(0.2)
    return int(marker.read_text())


def _raylet_of(cluster, pid: int):
    """The cluster node whose raylet started worker ``pid`` (a Ray worker's parent)."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    for node in cluster.worker_nodes:
        if any(p.process.pid == ppid for p in node.all_processes.get("raylet", [])):
            return node
    raise AssertionError(f"worker {pid}: no node's raylet is its parent ({ppid})")


@needs_ray
@pytest.mark.slow
def test_node_lost_mid_way_is_retried(tiny_k3, ref, cluster, tmp_path):
    """The last test here to use the cluster: it takes a node away. A task stops after renaming its 2nd shard (not yet
    reported); its node is killed (raylet, workers and all); Ray re-runs the task on the other node."""
    marker = tmp_path / "paused"
    with child([sys.executable, "-m", "kimi_convert.cli", "pack", relative(tiny_k3, tmp_path), "out", *PACK_ARGS,
                "--ray", cluster.address], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
               env={**os.environ, "KIMI_CONVERT_FAULT": "shard:2:pause", "KIMI_CONVERT_FAULT_ONCE": str(marker)}) as p:
        pid = wait_for(marker, p)
        node = _raylet_of(cluster, pid)
        cluster.remove_node(node, allow_graceful=False)
        if alive(pid):  # the node is gone: none of its processes may go on
            os.kill(pid, signal.SIGKILL)
        _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert resubmitted(cluster, p.pid) == 1
    assert fault_inject.same_tree(ref, tmp_path / "out") == []


# -- without a cluster: where tasks go, and what a re-run task does (raycluster._task is a plain generator)


def _node(cpu: float, gpu: float = 0, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": cpu, **({"GPU": gpu} if gpu else {})}}


def test_placement_from_the_cluster_resources():
    from kimi_convert.errors import ConvertError
    from kimi_convert.raycluster import Placement, placement

    # this file's cluster: a head without CPUs, two nodes of one: a task of one CPU on each
    assert placement("auto", [_node(0), _node(1), _node(1)]) == Placement("cpu", 1, 0, 2)
    # CPU tasks of up to 4 CPUs; dead nodes ignored; --device reference / triton run as CPU tasks
    assert placement("auto", [_node(16), _node(64), _node(8, alive=False)]) == Placement("cpu", 4, 0, 20)
    assert placement("reference", [_node(16, 2)]) == Placement("reference", 4, 0, 4)
    # GPU tasks: a GPU's share of its node's CPUs; one task per 4 of them, at most 4 a GPU, sharing it
    assert placement("auto", [_node(4), _node(64, 8), _node(64, 8)]) == Placement("cuda", 4, 0.5, 32)
    assert placement("cuda", [_node(2, 1)]) == Placement("cuda", 2, 1.0, 1)
    assert placement("auto", [_node(128, 8)]) == Placement("cuda", 4, 0.25, 32)
    assert placement("auto", [_node(96, 8)]).num_gpus == 0.3333
    for device, nodes, msg in [("cuda", [_node(8)], "no node of the Ray cluster has a GPU"),
                               ("cuda:1", [_node(8, 2)], "names a GPU of this machine"),
                               ("auto", [_node(0), _node(4, alive=False)], "no node with a CPU")]:
        with pytest.raises(ConvertError, match=msg):
            placement(device, nodes)


def test_a_rerun_task_keeps_journaled_shards_and_rewrites_the_rest(tiny_k3, ref, tmp_path):
    from kimi_convert.journal import Journal
    from kimi_convert.pack import load_plan, split_jobs
    from kimi_convert.raycluster import _task

    ckpt, plan = load_plan(tiny_k3, Options(max_shard_size=300_000, recipe="nvfp4-w4a16", layout="sglang"))
    out = tmp_path / "out"
    out.mkdir()
    shards = [s.file for s in plan.shards[:5]]
    [job] = split_jobs(ckpt, plan, plan.shards[:5], 1, out)
    first = list(_task(job, "cpu", 1))
    assert [item[:2] for item in first[:-1]] == [("shard", f) for f in shards] and first[-1][0] == "done"
    assert all((out / f).read_bytes() == (ref / f).read_bytes() for f in shards)
    # the attempt that died: the driver had journaled shards 1-3, and shard 2 has changed since; shard 4 was
    # renamed, not reported; shard 5 was half written
    Journal("plan", "cmd", {}, {f: rec for _, f, rec in first[:3]}).save(out)
    with open(out / shards[1], "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"X")
    (out / shards[4]).rename(out / (shards[4] + ".partial"))
    with open(out / (shards[4] + ".partial"), "r+b") as f:
        f.truncate(1000)
    inode = {f: (out / f).stat().st_ino for f in shards[:4]}
    again = list(_task(job, "cpu", 1))
    assert again[:-1] == first[:-1]  # the same records in the same order: Ray's replay of a generator
    assert again[-1][1].input_hashes == first[-1][1].input_hashes
    assert [(out / f).stat().st_ino == inode[f] for f in shards[:4]] == [True, False, True, False]  # kept or new
    assert all((out / f).read_bytes() == (ref / f).read_bytes() for f in shards)
    assert not list(out.glob("*.partial"))
