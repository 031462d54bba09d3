"""The MoE layer's sequencing: attention+router -> dispatch -> experts -> combine -> aggregate.

A model file writes stages 1 (attention_stage), 3 (expert_stage) and 5 (aggregate_stage) of its layers;
this module owns stages 2 and 4 (dispatch and combine) and runs the five in order. That plain order is
the single-process reference that every parallel and pipelined schedule is compared against.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pith_ops.token_permute import combine_tokens, count_per_expert, dispatch_tokens, sort_by_expert


@dataclass
class Routing:
    """The router's decision for a flat batch of tokens."""
    expert_ids: torch.Tensor   # [tokens, top_k] int64
    weights: torch.Tensor      # [tokens, top_k], the routing weight of each chosen expert


@dataclass
class DispatchPlan:
    order: torch.Tensor              # slot indices (token * top_k + k) sorted by expert
    inverse: torch.Tensor            # the row of each slot in expert order
    tokens_per_expert: torch.Tensor  # [num_experts]
    top_k: int


def dispatch(tokens: torch.Tensor, routing: Routing, num_experts: int) -> tuple[torch.Tensor, DispatchPlan]:
    """Stage 2: tokens [tokens, hidden] -> one row per (token, expert) slot, grouped by expert."""
    order, inverse, tokens_per_expert = sort_by_expert(routing.expert_ids, num_experts)
    top_k = routing.expert_ids.shape[1]
    return dispatch_tokens(tokens, order, inverse, top_k), DispatchPlan(order, inverse, tokens_per_expert, top_k)


def combine(expert_out: torch.Tensor, routing: Routing, plan: DispatchPlan) -> torch.Tensor:
    """Stage 4: expert outputs in expert order -> [tokens, hidden], each token's outputs times its routing
    weights, summed (fused: the [tokens, top_k, hidden] intermediate is never written)."""
    return combine_tokens(expert_out, routing.weights, plan.order, plan.inverse, plan.top_k)


def run_moe_layer(layer, x: torch.Tensor, *attention_args) -> torch.Tensor:
    """Run one MoE decoder layer's five stages in order on one process."""
    hidden, tokens, routing = layer.attention_stage(x, *attention_args)
    expert_in, plan = dispatch(tokens, routing, layer.num_experts)
    expert_out = layer.expert_stage(expert_in, plan.tokens_per_expert)
    return layer.aggregate_stage(hidden, tokens, combine(expert_out, routing, plan))


def switch_aux_loss(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch load-balancing loss of one layer: num_experts * sum_e (fraction of tokens routed to e) *
    (mean router probability of e), probs [tokens, E] the softmax over all experts (transformers'
    load_balancing_loss_func for one layer)."""
    counts = count_per_expert(expert_ids, num_experts).to(probs.dtype)
    return num_experts * (counts / probs.shape[0] * probs.mean(0)).sum()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on x whose backward also seeds d(aux)/d(aux) = 1, so a load-balancing loss reaches the
    router through the main loss's backward (and later through a pipeline) without being returned."""

    @staticmethod
    def forward(ctx, x, aux_loss):
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        return grad_x, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad_x.device)


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    return _AttachAuxLoss.apply(x, aux_loss)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits whose backward is the reverse exchange: the gradient of each
    received row goes back to the rank that sent it."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad.new_empty(sum(ctx.send_counts), *grad.shape[1:])
        dist.all_to_all_single(grad_x, grad.contiguous(), ctx.send_counts, ctx.recv_counts, group=ctx.group)
        return grad_x, None, None, None


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None) -> torch.Tensor:
    """Rows [sum(send_counts), ...] sent in rank order (send_counts[r] rows to rank r) -> the rows every
    rank sent here, in rank order [sum(recv_counts), ...]; differentiable."""
    return _AllToAll.apply(x, list(send_counts), list(recv_counts), group)
