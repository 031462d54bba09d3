"""Run a test body on N spawned CPU processes joined by gloo; a failure in any process fails the test."""
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, body, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank left waiting (a receive no one sends, a collective another rank skipped) fails, not hangs, the test
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    try:
        body(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # the body passed: leave without the interpreter's teardown, where gloo's sub-groups (the device mesh's) were
    # destroyed and aborted a passed test's process once in CI (std::terminate); 0 of 25 runs reproduced it here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_processes(world: int, body, *args):
    """body(rank, world, *args) on `world` processes; body must be a module-level function (it is pickled)."""
    mp.spawn(_worker, args=(world, free_port(), body, args), nprocs=world, join=True)
