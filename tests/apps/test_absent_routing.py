"""Routings with absent slots through whole models: a router that gives some tokens one expert and others top_k
(fewer_experts), under ep 2 and 4, cp 2 and dp 2 x ep 2 against one process (loss, every gradient, the step's
expert loads and aux loss); and the app's --capacity-factor run against the same run with the capacity rule
written as a loop (test_absent_slots.drop_by_loop), its experts_per_token scalar the slots kept."""
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import pith_apps.train as train_app
from distributed import run_on_processes
from pith_engine.context_parallel import zigzag_part
from pith_engine.data_parallel import clip_grad_norm
from pith_engine.moe import LoadBalance, update_expert_bias
from pith_engine.parallel import Parallel
from test_parallel_training import BATCH, assert_the_one_process_step, build, full_state, global_batch
from test_train import tensorboard_events

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_absent_slots import drop_by_loop  # noqa: E402

select = LoadBalance.select


def fewer_selected(self, scores, top_k, allowed=None):
    """select, then each slot after the first kept only where its score is at least 0.9 of the first's."""
    expert_ids, chosen = select(self, scores, top_k, allowed)
    kept = torch.cat([torch.ones_like(chosen[:, :1], dtype=torch.bool), chosen[:, 1:] >= 0.9 * chosen[:, :1]], 1)
    return torch.where(kept, expert_ids, -1), chosen


@contextmanager
def fewer_experts():
    with mock.patch.object(LoadBalance, "select", fewer_selected):
        yield


def step(family, parallel):
    """One step of this rank's share of the global batch: loss, clipped norm, gradients, loads and aux loss."""
    model = build(family, parallel, None)
    ids, labels = global_batch(model.config.vocab_size)
    share = BATCH // parallel.data_ranks
    rows = slice(parallel.data_rank * share, (parallel.data_rank + 1) * share)
    ids, labels, total = ids[rows], labels[rows], labels.numel()
    if parallel.cp > 1:
        ids, labels = (zigzag_part(t, parallel.cp, parallel.coords["cp"]) for t in (ids, labels))
    loss = model.loss_sum(ids, labels) / total
    loss.backward()
    norm = clip_grad_norm(model.parameters(), 0.5)
    loads, aux = update_expert_bias(model)
    return dict(loss=loss.detach(), norm=norm, state=full_state(model), loads=loads, aux=aux)


LAYOUTS = [("qwen3", 1, 2, 1), ("qwen3", 1, 1, 2), ("gpt_oss", 1, 2, 1), ("deepseek_v2", 1, 2, 1),
           ("qwen3", 1, 4, 1), ("qwen3", 2, 2, 1)]   # (family, dp, ep, cp)


def layouts_body(rank, world, layouts, out):
    with fewer_experts():
        for family, dp, ep, cp in layouts:
            result = step(family, Parallel.build(dp=dp, ep=ep, cp=cp))
            dist.all_reduce(result["loss"])
            torch.save(result, out / f"{family}-{dp}-{ep}-{cp}-{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("absent")
    for world in (2, 4):
        run_on_processes(world, layouts_body, [layout for layout in LAYOUTS if layout[1] * layout[2] * layout[3] == world],
                         out)
    return out


@pytest.mark.parametrize("family,dp,ep,cp", LAYOUTS)
def test_a_router_giving_tokens_one_to_top_k_experts_steps_as_one_process(family, dp, ep, cp, results):
    """Some tokens route to one expert, others to top_k; the step is the one process's (float32: loss 1e-6,
    gradients 1e-5), the loads and aux loss too (1e-6), and the loads count the slots kept only."""
    with fewer_experts():
        reference = step(family, Parallel())
    ranks = [torch.load(results / f"{family}-{dp}-{ep}-{cp}-{rank}.pt") for rank in range(dp * ep * cp)]
    assert_the_one_process_step(family, (reference["loss"], reference["norm"], reference["state"]), ranks)
    slots, top_k = reference["loads"].sum(1), build(family, Parallel(), None).layers[1].top_k
    assert torch.all(slots < 0.8 * BATCH * 16 * top_k) and torch.all(slots > BATCH * 16)   # 1 to top_k a token
    for result in ranks:
        assert torch.equal(result["loads"], reference["loads"])
        assert abs(result["aux"] - reference["aux"]) <= 1e-6 * reference["aux"]


RUN = ["qwen3", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--quiet", "--peak-tflops", "0.05"]


def test_the_capacity_factor_run_is_the_run_whose_router_drops_by_the_loop(tmp_path):
    """--capacity-factor 0.75 against --capacity-factor off with select dropping as drop_by_loop does (capacity
    ceil(0.75 x 128 x 2 / 8) = 24 of a micro-batch's 128 tokens x top 2 over 8 experts): the same losses (1e-6);
    experts_per_token below top_k, the MFU counting it."""
    capped = train_app.train(train_app.parse_args([*RUN, "--out", str(tmp_path / "capped"), "--capacity-factor", "0.75"]))

    def by_loop(self, scores, top_k, allowed=None):
        expert_ids, chosen = select(self, scores, top_k, allowed)
        return drop_by_loop(expert_ids, 24), chosen
    with mock.patch.object(LoadBalance, "select", by_loop):
        looped = train_app.train(train_app.parse_args([*RUN, "--out", str(tmp_path / "looped")]))
    free = train_app.train(train_app.parse_args([*RUN, "--out", str(tmp_path / "free")]))
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(capped, looped)) and capped != free
    capped_tb, free_tb = (tensorboard_events(tmp_path / name / "tb") for name in ("capped", "free"))

    def values(events, tag):
        return [event.value for event in events.Scalars(tag)]
    assert all(1.0 < value < 2 * 0.75 + 1e-6 for value in values(capped_tb, "train/experts_per_token"))
    assert values(free_tb, "train/experts_per_token") == [2.0] * 4
    # the MFU's FLOPs per token: fewer expert GEMMs where fewer slots were kept (at one speed, a lower MFU)
    ratio, free_ratio = ([m / s for m, s in zip(values(tb, "train/mfu_pct"), values(tb, "train/tokens_per_s"))]
                         for tb in (capped_tb, free_tb))
    assert all(a < b * (1 - 1e-4) for a, b in zip(ratio, free_ratio))


def test_an_fp8_capacity_run_follows_the_unquantized_one(tmp_path):
    """--fp8 (the experts' GEMMs, emulated on CPU) with slots over capacity absent: the expert rows past the experts'
    ranges are quantized and never read; the losses within 3% of the run without --fp8 (test_fp8_train's bound)."""
    runs = [train_app.train(train_app.parse_args([*RUN, "--out", str(tmp_path / str(n)), "--capacity-factor", "0.75",
                                                  *flags])) for n, flags in enumerate(([], ["--fp8"]))]
    assert max(abs(a - b) / a for a, b in zip(*runs)) < 3e-2 and runs[0] != runs[1]
