"""Hybrid sharding (--dp-replicate) on 4 gloo processes against one process and against full sharding: the same
losses and gradient norms, a norm that counts each gradient element once, and resumes between the two."""
import json
import math
import shutil

import pytest
import torch
import torch.distributed as dist

import pith_apps.train as train_app
from distributed import run_on_processes
from pith_engine.data_parallel import grad_norm
from pith_engine.parallel import LayoutError, Parallel

# constant LR after warmup, so that a run stopped at step 3 and resumed to 6 has the schedule of a 6-step run
RUN = ["qwen3", "--batch-size", "8", "--seq-len", "32", "--warmup", "2", "--schedule", "constant", "--quiet",
       "--save-every", "3"]


def train(out, steps, *flags):
    return train_app.train(train_app.parse_args([*RUN, "--out", str(out), "--steps", str(steps), *flags]))


def grad_norms(folder) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars("train/grad_norm")]


def four_process_runs(rank, world, root):
    """HSDP 2 x 2 for 6 steps; 2 replicas of 1 shard beside ep 2; full sharding (dp 4) steps 1-3 resumed by HSDP
    to 6 and HSDP 1-3 resumed by full sharding and by 4 replicas of 1 shard (plain replication); and the norm of one backward summed over one replica and over the
    world."""
    hsdp, full = ["--dp", "4", "--dp-replicate", "2"], ["--dp", "4"]
    losses = {"hsdp": train(root / "hsdp", 6, *hsdp),
              "hsdp-ep2": train(root / "hsdp-ep2", 6, "--dp", "2", "--dp-replicate", "2", "--ep", "2"),
              "full-then-hsdp": train(root / "full-then-hsdp", 3, *full),
              "hsdp-then-full": train(root / "hsdp-then-full", 3, *hsdp)}
    losses["full-then-hsdp"] += train(root / "full-then-hsdp", 6, *hsdp, "--resume")
    if rank == 0:
        shutil.copytree(root / "hsdp-then-full", root / "hsdp-then-4-replicas")
    dist.barrier()
    losses["hsdp-then-full"] += train(root / "hsdp-then-full", 6, *full, "--resume")
    losses["hsdp-then-4-replicas"] = losses["hsdp-then-full"][:3] + train(
        root / "hsdp-then-4-replicas", 6, "--dp", "4", "--dp-replicate", "4", "--resume")
    parallel = Parallel.build(dp=4, dp_replicate=2)
    args = train_app.parse_args(RUN)
    model = train_app.build_model(train_app.MODELS["qwen3"][1], train_app.model_config(args), parallel,
                                  torch.device("cpu"), None, 0, 32)
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(rank // 2))   # a replica's rows
    (model.loss_sum(ids[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()).backward()
    norms = {"replica": grad_norm(model.parameters(), parallel).item(), "world": grad_norm(model.parameters()).item()}
    if rank == 0:
        (root / "results.json").write_text(json.dumps(dict(losses=losses, norms=norms)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    run_on_processes(4, four_process_runs, root)
    results = json.loads((root / "results.json").read_text())
    results["losses"]["one"] = train(root / "one", 6)
    results["root"] = root
    return results


@pytest.mark.parametrize("name", ["hsdp", "hsdp-ep2", "full-then-hsdp", "hsdp-then-full", "hsdp-then-4-replicas"])
def test_hybrid_sharding_logs_the_one_process_losses_and_gradient_norms(runs, name):
    """Float32 on CPU: losses within 1e-5 of one process's at every step (the same as full sharding, summation
    order only), and so is the clipped gradient norm TensorBoard logs; the resumes run steps 4-6 of the same run."""
    ours, one = runs["losses"][name], runs["losses"]["one"]
    assert len(ours) == 6 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, one)), (ours, one)
    norms, reference = grad_norms(runs["root"] / name), grad_norms(runs["root"] / "one")
    assert len(norms) == 6 and all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, reference)), (norms, reference)


def test_the_norm_counts_each_element_once_where_a_world_sum_counts_it_per_replica(runs):
    """The same backward: summed over the world, the squares of the 2 replicas' identical shards count twice, so
    that norm is sqrt(2) times the replica's (1e-6); the app's norms above are the replica's."""
    norms = runs["norms"]
    assert abs(norms["world"] / norms["replica"] - math.sqrt(2)) < 1e-6


def test_a_replica_count_that_does_not_divide_dp_is_refused():
    with pytest.raises(LayoutError, match=r"--dp-replicate 3 must divide --dp 4 .* choose one of \[1, 2, 4\]"):
        Parallel.build(dp=4, dp_replicate=3)
