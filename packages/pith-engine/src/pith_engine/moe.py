"""The MoE layer's sequencing: attention+router -> dispatch -> experts -> combine -> aggregate.

A model file writes stages 1 (attention_stage), 3 (expert_stage) and 5 (aggregate_stage) of its layers;
this module owns stages 2 and 4 (dispatch and combine) and runs the five in order. That plain order is
the single-process reference that every parallel and pipelined schedule is compared against.

Each all-to-all goes through `exchange`: while a pipeline's overlapped pair runs (`comm_turns`, set by
pith_engine.dualpipev), the other micro-batch's computation runs while it is in flight.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from pith_engine.contract import MoeLayer
from pith_ops.token_permute import (combine_tokens, count_per_expert, dedup_by_rank, dispatch_tokens, ranks_of_tokens,
                                   sort_by_expert)


@dataclass
class Routing:
    """The router's decision for a flat batch of tokens: top_k slots a token, each an expert id or -1, absent (no
    expert: a router that picks fewer than top_k for some tokens, a slot over its expert's capacity). An absent
    slot costs nothing past the router: it is not sent, computed, counted in loads or aux losses, or combined."""
    expert_ids: torch.Tensor   # [tokens, top_k] int64
    weights: torch.Tensor      # [tokens, top_k], the routing weight of each chosen expert (an absent slot's unread)


@dataclass
class DispatchPlan:
    order: torch.Tensor              # slot indices (row * top_k + k) sorted by expert
    inverse: torch.Tensor            # the row of each slot in expert order (-1: the slot's expert is elsewhere)
    tokens_per_expert: torch.Tensor  # [local experts]
    top_k: int
    weights: torch.Tensor            # [rows, top_k] routing weights of the rows the experts see
    exchange: "Exchange | None" = None


@dataclass
class Exchange:
    """How this rank's tokens went out to the expert-parallel group: one row per (token, destination rank)."""
    group: object
    pair_slot: torch.Tensor      # token * ranks + rank of each pair sent, in send order
    pair_inverse: torch.Tensor   # [tokens * ranks]: the send row of each (token, rank), -1 when not sent
    send_counts: list[int]
    recv_counts: list[int]


def dispatch(tokens: torch.Tensor, routing: Routing, num_experts: int, group=None) -> tuple[torch.Tensor, DispatchPlan]:
    """Stage 2: tokens [tokens, hidden] -> one row per (token, local expert) slot, grouped by expert. With an
    expert-parallel group, expert e lives on group rank e // (num_experts / ranks) and each token travels
    once to each rank that holds any of its experts (the rows sent are (token, rank) pairs; absent slots, -1, go
    nowhere). On one process the rows are every slot's, absent ones last and never read: a size the host knows."""
    rows, plan = send_rows(tokens, routing, num_experts, group)
    return dispatch_tokens(rows, plan.order, plan.inverse, plan.top_k), plan


def send_rows(tokens: torch.Tensor, routing: Routing, num_experts: int, group=None) -> tuple[torch.Tensor, DispatchPlan]:
    """Stage 2 up to the rows this rank's experts read, before their gather into expert order: the tokens
    themselves on one process, the (token, rank) pairs received under expert parallelism."""
    top_k = routing.expert_ids.shape[1]
    if group is None:
        order, inverse, tokens_per_expert = sort_by_expert(routing.expert_ids, num_experts)
        return tokens, DispatchPlan(order, inverse, tokens_per_expert, top_k, routing.weights)
    ranks = dist.get_world_size(group)
    local_experts = num_experts // ranks
    goes_to = ranks_of_tokens(routing.expert_ids, local_experts, ranks)
    counts = torch.stack([goes_to.sum(0), count_per_expert(routing.expert_ids // local_experts, ranks)], 1)
    received = torch.empty_like(counts)
    exchange(received, counts, None, None, group)
    sent, got = torch.stack([counts, received]).tolist()   # the one host sync: all_to_all needs sizes
    send_counts, recv_counts = [pairs for pairs, _ in sent], [pairs for pairs, _ in got]
    pair_token, pair_rank, local_ids = dedup_by_rank(routing.expert_ids, local_experts, goes_to, sum(send_counts))
    pair_slot = pair_token * ranks + pair_rank
    pair_inverse = torch.full((tokens.shape[0] * ranks,), -1, dtype=torch.int64, device=tokens.device)
    pair_inverse[pair_slot] = torch.arange(pair_slot.numel(), device=tokens.device)
    pair_weights = torch.where(local_ids >= 0, routing.weights[pair_token], 0)
    rows = all_to_all(dispatch_tokens(tokens, pair_slot, pair_inverse, ranks), send_counts, recv_counts, group)
    row_ids = all_to_all(local_ids, send_counts, recv_counts, group)
    row_weights = all_to_all(pair_weights, send_counts, recv_counts, group)
    order, inverse, tokens_per_expert = sort_by_expert(row_ids, local_experts, present=sum(slots for _, slots in got))
    return rows, DispatchPlan(order, inverse, tokens_per_expert, top_k, row_weights,
                              Exchange(group, pair_slot, pair_inverse, send_counts, recv_counts))


def combine(expert_out: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Stage 4: expert outputs in expert order -> [tokens, hidden], each token's outputs times its routing
    weights, summed (fused: the [tokens, top_k, hidden] intermediate is never written). Under expert
    parallelism the sum over a rank's experts is taken there, so one row per (token, rank) travels back."""
    return combine_back(combine_tokens(expert_out, plan.weights, plan.order, plan.inverse, plan.top_k), plan)


def combine_back(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Combine from the sums over this rank's experts: back to the tokens' ranks and summed there."""
    exchange = plan.exchange
    if exchange is None:
        return rows
    back = all_to_all(rows, exchange.recv_counts, exchange.send_counts, exchange.group)
    ranks = len(exchange.send_counts)
    unit = torch.ones(exchange.pair_inverse.numel() // ranks, ranks, dtype=back.dtype, device=back.device)
    return combine_tokens(back, unit, exchange.pair_slot, exchange.pair_inverse, ranks)


def local_experts(layer: MoeLayer, rows: torch.Tensor, tokens_per_expert, weights, order, inverse, top_k: int):
    """What runs between the two exchanges: the rows gathered into expert order (dispatch's end), the experts
    (stage 3) and the weighted sum over them (combine's start); one region for activation recompute."""
    expert_out = layer.expert_stage(dispatch_tokens(rows, order, inverse, top_k), tokens_per_expert)
    return combine_tokens(expert_out, weights, order, inverse, top_k)


def run_moe_layer(layer: MoeLayer, x: torch.Tensor, *layer_args) -> torch.Tensor:
    """Run one MoE decoder layer's five stages in order; its experts module says which expert-parallel group
    (if any) its experts are spread over. Under activation recompute (pith_engine.recompute) the experts are one
    region, `layer.recomputed_experts`, between the all-to-alls, which never run twice."""
    hidden, tokens, routing = layer.attention_stage(x, *layer_args)
    experts = getattr(layer, "recomputed_experts", None)
    if experts is None:
        expert_in, plan = dispatch(tokens, routing, layer.num_experts, layer.experts.ep_group)
        return layer.aggregate_stage(hidden, tokens, combine(layer.expert_stage(expert_in, plan.tokens_per_expert), plan))
    rows, plan = send_rows(tokens, routing, layer.num_experts, layer.experts.ep_group)
    summed = experts(rows, plan.tokens_per_expert, plan.weights, plan.order, plan.inverse, plan.top_k)
    return layer.aggregate_stage(hidden, tokens, combine_back(summed, plan))


BALANCE_MODES = ("global_batch", "micro_batch", "sequence", "aux_free")


class LoadBalance(nn.Module):
    """One MoE layer's load balancing, chosen per run:
    - an aux loss coef * scale * sum_e f_e * P_e, f_e = slots routed to e / tokens and P_e = mean router
      probability of e, over a balancing unit: a micro-batch of all data ranks together ("global_batch";
      on one process, the micro-batch), each rank's own micro-batch ("micro_batch") or each sequence
      ("sequence"), averaged over all units of an optimizer step (micro_batches micro-batches of every data
      rank); scale is num_experts (switch loss) or num_experts / top_k (DeepSeek). Under context parallelism
      (context_group, the cp ranks sharing each sequence) a unit's counts are summed over its cp ranks, so
      a data rank's micro-batch and a sequence are the same units as on one process. Each rank attaches its
      share, so the gradients summed over data ranks and micro-batches are those of the step's loss.
    - "aux_free": no loss; a per-expert bias added to the scores steers which experts are chosen (not their
      weights) and moves by bias_rate toward the mean load after every optimizer step (DeepSeek-V3).
    capacity_factor (the app's --capacity-factor; None: dropless): each expert takes at most
    ceil(factor * slots / experts) of the slots a rank routes in a micro-batch (drop_over_capacity); the rest are
    absent. Loads and the aux loss count the slots kept."""
    capacity_factor = None

    def __init__(self, num_experts: int, mode: str, coef: float, scale: float, data_group=None, bias_rate: float = 1e-3,
                 micro_batches: int = 1, context_group=None):
        super().__init__()
        if mode not in BALANCE_MODES:
            raise ValueError(f"load balance mode {mode!r} is unknown; valid: {', '.join(BALANCE_MODES)}")
        self.num_experts, self.mode, self.coef, self.scale = num_experts, mode, coef, scale
        self.data_group, self.bias_rate, self.micro_batches = data_group, bias_rate, micro_batches
        self.data_ranks = dist.get_world_size(data_group) if data_group is not None else 1
        self.context_group = context_group
        self.context_ranks = dist.get_world_size(context_group) if context_group is not None else 1
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        # what the training forwards of this step routed (slots per expert) and attached (aux loss), this rank's
        self.register_buffer("expert_load", torch.zeros(num_experts), persistent=False)
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.replaying = False   # an eager recompute of the forward (pith_engine.recompute): counted once already

    def _apply(self, fn, recurse=True):
        """The buffers stay fp32 through a model.to(bfloat16): in bf16 a load count stops at 256 and a bias
        near 0.5 no longer moves by 1e-3."""
        super()._apply(fn, recurse)
        self.expert_bias, self.expert_load = self.expert_bias.float(), self.expert_load.float()
        self.aux_loss = self.aux_loss.float()
        return self

    def select(self, scores: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None):
        """(expert_ids, their scores) of the top_k experts of each token, among the `allowed` ones ([tokens, E]
        bool; None: all). A masked expert is never chosen, whatever its score or aux-free bias."""
        candidates = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
        if self.mode != "aux_free":
            chosen, expert_ids = candidates.topk(top_k, dim=-1)
        else:
            expert_ids = (candidates + self.expert_bias).topk(top_k, dim=-1).indices
            chosen = scores.gather(-1, expert_ids)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * expert_ids.numel() / self.num_experts)
            expert_ids = drop_over_capacity(expert_ids, self.num_experts, capacity)
        return expert_ids, chosen

    def attach_loss(self, hidden: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor, sequences: int):
        """hidden, carrying this rank's share of the aux loss into the backward (probs [tokens, E] fp32); the slots
        of expert_ids, the layer's final routing (a variant's slots made absent after select, left out), counted
        into expert_load."""
        if torch.is_grad_enabled() and not self.replaying:   # a training forward (not an evaluation or a recompute)
            self.expert_load += count_per_expert(expert_ids, self.num_experts)
        if self.mode == "aux_free" or self.coef == 0:
            return hidden
        share = self.coef * self.scale * self.loss_share(probs, expert_ids, sequences)
        if torch.is_grad_enabled() and not self.replaying:
            self.aux_loss += share.detach()
        return attach_aux_loss(hidden, share)

    def loss_share(self, probs, expert_ids, sequences: int) -> torch.Tensor:
        """sum_e f_e * P_e of this rank's tokens of one micro-batch, as its share of the mean over all balancing
        units of the step."""
        units = sequences if self.mode == "sequence" else 1
        ids = expert_ids.reshape(units, -1)
        ids = torch.where(ids >= 0, ids, self.num_experts)   # absent slots in a column of their own, dropped
        counts = torch.zeros(units, self.num_experts + 1, device=probs.device).scatter_add_(
            1, ids, torch.ones(ids.shape, device=probs.device))[:, :-1]
        tokens = probs.shape[0] // units
        prob_sums = probs.reshape(units, tokens, -1).sum(1)
        if self.context_group is not None and self.mode != "global_batch":   # a unit's tokens are on all its cp ranks
            counts = funcol.all_reduce(counts, "sum", self.context_group)
            tokens *= self.context_ranks
            return (counts / tokens * prob_sums / tokens).sum() / (units * self.data_ranks // self.context_ranks
                                                                   * self.micro_batches)
        if self.mode == "global_batch":   # one unit: every data rank's tokens; counts from all, probs from here
            if self.data_group is not None:
                counts = funcol.all_reduce(counts, "sum", self.data_group)
            tokens *= self.data_ranks
            return (counts / tokens * prob_sums / tokens).sum() / self.micro_batches
        return (counts / tokens * prob_sums / tokens).sum() / (units * self.data_ranks * self.micro_batches)

    def move_bias(self, loads: torch.Tensor):
        """aux_free, after an optimizer step: each expert's bias moves by bias_rate toward the mean load."""
        self.expert_bias += self.bias_rate * torch.sign(loads.mean() - loads)


def drop_over_capacity(expert_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """expert_ids [tokens, top_k] with each expert's slots past its first `capacity` made absent (-1): the tokens'
    first choices in token order come first, then their second choices, and so on (GShard's priority). On the
    device, no host sync: a slot's place among its expert's slots is a running count of one-hot rows."""
    by_choice = expert_ids.T.reshape(-1)
    onehot = by_choice[:, None] == torch.arange(num_experts, device=by_choice.device)   # (F.one_hot reads its max)
    place = (onehot.cumsum(0) * onehot).sum(1)   # 1 for an expert's first slot, 0 for an absent one
    return torch.where(place <= capacity, by_choice, -1).view(expert_ids.shape[1], -1).T.contiguous()


@torch.no_grad()
def update_expert_bias(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """After an optimizer step: the step's expert loads ([MoE layers, experts], slots routed to each) and aux loss,
    summed over data ranks (one all-reduce), which aux_free layers move their biases by; both counts start over.
    None for a model without MoE layers."""
    balances = [module for module in model.modules() if isinstance(module, LoadBalance)]
    if not balances:
        return None
    stats = torch.stack([torch.cat([b.expert_load, b.aux_loss.view(1)]) for b in balances])
    if balances[0].data_group is not None:
        dist.all_reduce(stats, group=balances[0].data_group)
    for balance, row in zip(balances, stats):
        if balance.mode == "aux_free":
            balance.move_bias(row[:-1])
        balance.expert_load.zero_()
        balance.aux_loss.zero_()
    return stats[:, :-1], stats[:, -1].sum()


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


comm_turns = None   # while a pipeline's overlapped pair runs, its pith_engine.dualpipev.Turns


def exchange(out: torch.Tensor, x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    """all_to_all_single into `out`, launched, then, inside an overlapped pair, the turn passes to the other
    micro-batch (whose computation runs while this is in flight), then waited for."""
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    if comm_turns is not None:
        comm_turns.pass_turn()
    work.wait()
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits whose backward is the reverse exchange: the gradient of each
    received row goes back to the rank that sent it."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        return exchange(out, x.contiguous(), recv_counts, send_counts, group)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad.new_empty(sum(ctx.send_counts), *grad.shape[1:])
        return exchange(grad_x, grad.contiguous(), ctx.send_counts, ctx.recv_counts, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None) -> torch.Tensor:
    """Rows [sum(send_counts), ...] sent in rank order (send_counts[r] rows to rank r) -> the rows every
    rank sent here, in rank order [sum(recv_counts), ...]; differentiable."""
    return _AllToAll.apply(x, list(send_counts), list(recv_counts), group)
