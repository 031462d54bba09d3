"""Expert-parallel dispatch and combine over gloo against the same routing on one process."""
import pytest
import torch
import torch.distributed as dist

from conftest import relative_error
from distributed import run_on_processes
from pith_engine import moe
from pith_engine.moe import Routing, combine, dispatch

EXPERTS, TOKENS, HIDDEN, TOP_K = 8, 12, 6, 3


def rank_inputs(rank):
    """This rank's tokens, routing and output gradient (a function of the rank only)."""
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randn(TOKENS, HIDDEN, generator=generator)
    expert_ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=generator)
    return tokens, Routing(expert_ids, weights), torch.randn(TOKENS, HIDDEN, generator=generator)


def scale_experts(rows, tokens_per_expert, first_expert):
    """Expert e multiplies its rows by (e + 1) and adds e: a stand-in that tells experts apart."""
    ids = torch.repeat_interleave(torch.arange(len(tokens_per_expert)), tokens_per_expert) + first_expert
    return rows * (ids[:, None] + 1.0) + ids[:, None]


def moe_forward_backward(tokens, routing, grad, group, first_expert):
    tokens, weights = tokens.clone().requires_grad_(), routing.weights.clone().requires_grad_()
    expert_in, plan = dispatch(tokens, Routing(routing.expert_ids, weights), EXPERTS, group)
    out = combine(scale_experts(expert_in, plan.tokens_per_expert, first_expert), plan)
    out.backward(grad)
    return out, tokens.grad, weights.grad


def expert_parallel_body(rank, world):
    sent = []
    original = moe.all_to_all
    moe.all_to_all = lambda x, send, recv, group: sent.append((x.shape[0], sum(send))) or original(x, send, recv, group)
    tokens, routing, grad = rank_inputs(rank)
    got = moe_forward_backward(tokens, routing, grad, dist.group.WORLD, rank * EXPERTS // world)
    expected = moe_forward_backward(tokens, routing, grad, None, 0)
    for a, b in zip(got, expected):
        assert relative_error(a, b) < 1e-6
    # dedup: the token rows sent are the (token, destination rank) pairs, fewer than the (token, expert) slots
    pairs = {(t, e // (EXPERTS // world)) for t, row in enumerate(routing.expert_ids.tolist()) for e in row}
    assert sent[0] == (len(pairs), len(pairs)) and len(pairs) < TOKENS * TOP_K
    moe.all_to_all = original


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_dispatch_and_combine_equal_one_process_and_send_each_token_once_per_rank(world):
    run_on_processes(world, expert_parallel_body)
