"""Every wait of a run on several processes is shared work or bounded: a rank left waiting in a collective stops after
--dist-timeout with one line naming the operation, its ranks and the line of Pith that waited, and writes its recent
collectives (torch's flight recorder) under <out>/comm-trace; every process group is made when the layout is built, in
one order on every rank (none later, where NCCL would make a communicator in the middle of a step); evaluation under
the pipeline passes activations through the pipeline group's batched exchange, as the step does."""
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import pith_apps.train as train_app
from distributed import free_port, run_on_processes
from pith_engine.parallel import Parallel
from test_no_lost_work import QUICK


def workers_of(launcher: int) -> dict[int, int]:
    """{RANK: pid} of torchrun's worker processes."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
        if parent == launcher and rank is not None:
            found[rank] = int(pid)
    return found


def gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_rank_left_waiting_stops_after_the_timeout_naming_what_it_waited_in(tmp_path, monkeypatch):
    """Rank 1 of 2 (dp 2) is stopped (SIGSTOP: a hung GPU or host looks the same to the others) once training runs:
    rank 0 stops 5 s (--dist-timeout 5) later, within 5 s more, with its one line; its trace file holds the
    collectives it issued, the last of them the one it waited in (gloo runs a reduce-scatter as an all-reduce: the
    recorder names either, with the call's stack)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                               str(free_port()), "-m", "pith_apps.train", *QUICK, "--dp", "2", "--device", "cpu",
                               "--save-every", "2", "--steps", "400", "--dist-timeout", "5", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (out / "checkpoints" / "latest").exists():
            assert launch.poll() is None, launch.communicate()
            time.sleep(0.1)
        workers = workers_of(launch.pid)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while not gone(workers[0]) and time.monotonic() - stopped < 60:
            time.sleep(0.1)
        waited = time.monotonic() - stopped
    finally:
        for pid in workers_of(launch.pid).values():
            os.kill(pid, signal.SIGKILL)
        _, err = launch.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.startswith("pith-train: error: ")]
    assert 5 <= waited < 10 and len(lines) == 1, (waited, err[-3000:])
    trace = out / "comm-trace" / "rank_0"
    found = re.fullmatch(r"pith-train: error: rank 0 waited 5 s \(--dist-timeout\) in (\w+) with ranks \[0, 1\] at "
                         r"\w+\.py:\d+ \(\w+\): a rank it waits for is stuck or gone; its recent collectives are in "
                         rf"{re.escape(str(trace))} \(skills/pith-apps/launch/SKILL.md reads them\); the last checkpoint "
                         r"is intact", lines[0])
    assert found, lines[0]
    entries = pickle.loads(trace.read_bytes())["entries"]
    last = {entries[-1]["profiling_name"].removeprefix("gloo:"), *(f["name"] for f in entries[-1]["frames"])}
    assert len(entries) > 10 and any(found.group(1).startswith(name) for name in last), (found.group(1), last)
    # the launch playbook's reading of the traces: torch's analyzer names the rank that wrote none
    analyzed = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(trace.parent),
                               "--prefix", "rank_", "--allow-incomplete-ranks"], capture_output=True, text=True)
    assert "missed FR dumps from ranks ({1})" in analyzed.stdout + analyzed.stderr, analyzed


def groups_body(rank, world, root):
    """pp 2 x dp 2 as 2 replicas (HSDP), with evaluation and checkpoints: the process groups after Parallel.build are
    all the run ever has; the pipeline's evaluation uses no plain send or recv."""
    built = Parallel.build.__func__
    counts = {}

    def build(cls, *args, **kwargs):
        parallel = built(cls, *args, **kwargs)
        counts["built"] = len(c10d._world.pg_map)
        return parallel
    Parallel.build = classmethod(build)

    def plain(*args, **kwargs):
        raise AssertionError("a plain send or recv")
    dist.send = dist.recv = plain
    train_app.train(train_app.parse_args([*QUICK, "--out", str(root / "run"), "--pp", "2", "--dp", "2",
                                          "--dp-replicate", "2", "--layers", "4", "--steps", "2", "--micro-batch-size", "1", "--save-every", "2",
                                          "--eval-every", "1", "--eval-batches", "1"]))
    assert counts["built"] == len(c10d._world.pg_map) > 5, (counts, len(c10d._world.pg_map))


def test_every_process_group_is_made_with_the_layout(tmp_path):
    run_on_processes(4, groups_body, tmp_path)
