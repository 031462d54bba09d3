"""Absent slots (expert id -1: fewer experts than top_k for a token, or a slot over its expert's capacity) through
dispatch, the experts and combine at ep 1, 2 and 4, against a reference that computes each token's present slots
only; the aux loss and loads that leave them out; the capacity limit against a loop that fills each expert in turn."""
import math

import pytest
import torch
import torch.distributed as dist

from conftest import relative_error
from distributed import run_on_processes
from pith_engine.moe import LoadBalance, Routing, combine, dispatch, drop_over_capacity

EXPERTS, TOKENS, HIDDEN, TOP_K = 8, 24, 6, 3


def rank_inputs(rank):
    """This rank's tokens, routing (a third of the slots absent, some tokens with none) and output gradient."""
    generator = torch.Generator().manual_seed(10 + rank)
    tokens = torch.randn(TOKENS, HIDDEN, generator=generator)
    expert_ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(TOKENS)])
    expert_ids[torch.rand(expert_ids.shape, generator=generator) < 0.35] = -1
    expert_ids[0] = -1
    weights = torch.rand(TOKENS, TOP_K, generator=generator)
    return tokens, Routing(expert_ids, weights), torch.randn(TOKENS, HIDDEN, generator=generator)


def experts_of_rows(rows, tokens_per_expert, first_expert):
    """Expert e: rows * (e + 1) + e; rows past the experts' ranges (the absent slots of a fixed-size buffer) NaN,
    so that a kernel or exchange that read them would spread NaN."""
    ends = torch.cumsum(tokens_per_expert, 0)
    index = torch.arange(rows.shape[0])
    ids = torch.searchsorted(ends, index, right=True).clamp(max=len(tokens_per_expert) - 1) + first_expert
    out = rows * (ids[:, None] + 1.0) + ids[:, None]
    return torch.where((index < ends[-1])[:, None], out, float("nan"))


def forward_backward(tokens, routing, grad, group, first_expert):
    tokens, weights = tokens.clone().requires_grad_(), routing.weights.clone().requires_grad_()
    expert_in, plan = dispatch(tokens, Routing(routing.expert_ids, weights), EXPERTS, group)
    out = combine(experts_of_rows(expert_in, plan.tokens_per_expert, first_expert), plan)
    out.backward(grad)
    return out, tokens.grad, weights.grad, expert_in.shape[0]


def reference(tokens, routing, grad):
    """Each token's sum over its present slots, written out; its gradients by autograd."""
    tokens, weights = tokens.clone().requires_grad_(), routing.weights.clone().requires_grad_()
    ids = routing.expert_ids
    present = (ids >= 0).unsqueeze(-1)
    scaled = tokens.unsqueeze(1) * (ids.clamp(min=0) + 1.0).unsqueeze(-1) + ids.clamp(min=0).unsqueeze(-1)
    out = torch.where(present, weights.unsqueeze(-1) * scaled, 0).sum(1)
    out.backward(grad)
    return out, tokens.grad, weights.grad


def test_one_process_keeps_every_slot_in_a_fixed_size_buffer_and_reads_only_the_present_ones():
    """ep 1: the experts get all TOKENS x TOP_K rows (no host sync for their count), those past the ranges NaN;
    output and gradients are the reference's, an absent slot's weight gradient 0."""
    tokens, routing, grad = rank_inputs(0)
    out, tokens_grad, weights_grad, rows = forward_backward(tokens, routing, grad, None, 0)
    assert rows == TOKENS * TOP_K and (routing.expert_ids < 0).sum() > TOKENS // 2
    for got, expected in zip((out, tokens_grad, weights_grad), reference(tokens, routing, grad)):
        assert relative_error(got, expected) < 1e-6
    assert torch.all(weights_grad[routing.expert_ids < 0] == 0) and torch.all(out[0] == 0)


def expert_parallel_body(rank, world):
    tokens, routing, grad = rank_inputs(rank)
    *got, rows = forward_backward(tokens, routing, grad, dist.group.WORLD, rank * EXPERTS // world)
    for a, b in zip(got, reference(tokens, routing, grad)):
        assert relative_error(a, b) < 1e-6
    # only the present slots travel and reach the experts: the rows received are this rank's experts' slots
    held = torch.tensor([[int(e) // (EXPERTS // world) == rank for e in rank_inputs(r)[1].expert_ids.flatten()]
                         for r in range(world)])
    assert rows == held.sum()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_sends_and_computes_only_the_present_slots(world):
    run_on_processes(world, expert_parallel_body)


@pytest.mark.parametrize("mode", ["global_batch", "sequence"])
def test_the_aux_loss_and_the_loads_leave_absent_slots_out(mode):
    """f_e counts the present slots only (over all the tokens), as the same routing written without them does."""
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=generator), -1)
    _, routing, _ = rank_inputs(1)
    balance = LoadBalance(EXPERTS, mode, coef=1.0, scale=EXPERTS)
    share = balance.loss_share(probs, routing.expert_ids, 2)
    units = 2 if mode == "sequence" else 1
    expected = 0.0
    for ids, p in zip(routing.expert_ids.chunk(units), probs.chunk(units)):
        counts = torch.tensor([(ids == e).sum().item() for e in range(EXPERTS)], dtype=torch.float32)
        expected += (counts / p.shape[0] * p.mean(0)).sum() / units
    assert share.item() == pytest.approx(expected.item(), rel=1e-6)
    with torch.enable_grad():
        balance.attach_loss(probs.requires_grad_(), probs, routing.expert_ids, 2)
    assert balance.expert_load.tolist() == [(routing.expert_ids == e).sum().item() for e in range(EXPERTS)]


def drop_by_loop(expert_ids, capacity):
    """The capacity rule written as a loop: first choices in token order, then second choices, ...; an expert full
    at `capacity` slots drops the rest."""
    kept, taken = expert_ids.clone(), {}
    for k in range(expert_ids.shape[1]):
        for t in range(expert_ids.shape[0]):
            e = int(expert_ids[t, k])
            if e >= 0:
                taken[e] = taken.get(e, 0) + 1
                if taken[e] > capacity:
                    kept[t, k] = -1
    return kept


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
def test_the_capacity_limit_drops_what_a_loop_filling_each_expert_in_turn_drops(factor):
    generator = torch.Generator().manual_seed(4)
    scores = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=generator) + torch.arange(EXPERTS) * 0.3, -1)
    balance = LoadBalance(EXPERTS, "global_batch", coef=1.0, scale=EXPERTS)
    free, _ = balance.select(scores, TOP_K)
    balance.capacity_factor = factor
    capped, weights = balance.select(scores, TOP_K)
    capacity = math.ceil(factor * TOKENS * TOP_K / EXPERTS)
    assert torch.equal(capped, drop_by_loop(free, capacity))
    assert torch.equal(weights, scores.gather(1, free))
    loads = torch.stack([(capped == e).sum() for e in range(EXPERTS)])
    assert loads.max() <= capacity and (factor >= 4.0) == torch.equal(capped, free)
    assert torch.equal(drop_over_capacity(capped, EXPERTS, capacity), capped)   # what is kept fits
