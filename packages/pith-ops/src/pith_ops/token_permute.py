"""Token permutation for MoE: sort (token, expert) slots by expert, gather tokens into expert-contiguous
order (dispatch), and sum the expert outputs back per token with the routing weights (combine).

A slot is one (token, k) pair of the router's top-k: slot s = token * top_k + k. `order` lists the
slots sorted by expert; `inverse` is its inverse permutation (where each slot's row landed). Because
both are permutations, every backward is a gather too: no atomics, deterministic, and nothing waits
for the host. The Triton kernels run on CUDA (or when asked, e.g. under TRITON_INTERPRET=1); torch
references run elsewhere.
"""
import torch
import triton
import triton.language as tl


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int, present: int | None = None, use_kernel=None):
    """expert_ids [tokens, top_k] -> (order [slots], inverse [slots], tokens_per_expert [E]): a stable sort, so
    each expert's slots keep token order.

    An id of -1 marks an absent slot (no expert): it gets inverse -1, which the gather-sum kernels skip, and sorts
    after every expert's slots, so rows past sum(tokens_per_expert) of the sorted order are absent ones, which no
    kernel reads (the grouped GEMMs leave them undefined). With `present` (the number of ids >= 0, known to the
    caller without a device sync) order stops there; without, it keeps every slot, a fixed size the host need not
    know. On CUDA (or with use_kernel) two Triton kernels sort by counting; elsewhere torch's argsort does."""
    flat = expert_ids.flatten()
    if use_kernel if use_kernel is not None else flat.is_cuda:
        order, inverse, tokens_per_expert = _counting_sort(flat, num_experts)
    else:
        order = torch.argsort(torch.where(flat >= 0, flat, num_experts), stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        inverse = torch.where(flat >= 0, inverse, -1)
        tokens_per_expert = count_per_expert(flat, num_experts)
    return (order if present is None else order[:present]), inverse, tokens_per_expert


@triton.jit
def _block_counts_kernel(ids_ptr, counts_ptr, slots, num_experts, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """counts[b, e]: how many slots of block b (slots b * BLOCK ...) go to expert e; absent ones (-1) and the
    last block's padding counted under e = num_experts."""
    block = tl.program_id(0)
    slot = block * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + slot, mask=slot < slots, other=-1).to(tl.int32)
    ids = tl.where(ids >= 0, ids, num_experts)
    tl.store(counts_ptr + block * BINS + tl.arange(0, BINS), tl.histogram(ids, BINS))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, order_ptr, inverse_ptr, per_expert_ptr, slots, num_experts, blocks,
                  BINS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Block b's share of a stable counting sort: a slot of expert e lands after every slot of the experts
    before e, of e in the blocks before b and of e before it in block b."""
    block = tl.program_id(0)
    bins = tl.arange(0, BINS)
    totals = tl.zeros((BINS,), tl.int32)
    earlier = tl.zeros((BINS,), tl.int32)
    for first in range(0, blocks, ROWS):
        rows = first + tl.arange(0, ROWS)
        counts = tl.load(counts_ptr + rows[:, None] * BINS + bins[None, :], mask=rows[:, None] < blocks, other=0)
        totals += tl.sum(counts, 0)
        earlier += tl.sum(tl.where(rows[:, None] < block, counts, 0), 0)
    own = tl.load(counts_ptr + block * BINS + bins)
    if block == 0:
        tl.store(per_expert_ptr + bins, totals.to(tl.int64), mask=bins < num_experts)
    # after a sort of (expert, slot) keys, this block's slots of expert e sit at cumsum(own)[e] - own[e] onwards
    start = tl.cumsum(totals, 0) - totals + earlier - (tl.cumsum(own, 0) - own)
    local = tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + block * BLOCK + local, mask=block * BLOCK + local < slots, other=-1).to(tl.int32)
    keys = tl.sort(tl.where(ids >= 0, ids, num_experts) * BLOCK + local)
    expert, slot = keys // BLOCK, block * BLOCK + keys % BLOCK
    position = tl.gather(start, expert, 0) + local
    placed = expert < num_experts
    tl.store(order_ptr + position, slot.to(tl.int64), mask=slot < slots)   # absent slots too: after every expert's
    tl.store(inverse_ptr + slot, tl.where(placed, position, -1).to(tl.int64), mask=slot < slots)


def _counting_sort(flat: torch.Tensor, num_experts: int, block: int = 1024):
    """sort_by_expert in two launches, where torch's argsort path takes about 27 (cub's radix sort alone 22)."""
    slots, bins = flat.numel(), triton.next_power_of_2(num_experts + 1)
    blocks = triton.cdiv(slots, block)
    counts = torch.empty(blocks, bins, dtype=torch.int32, device=flat.device)
    order = torch.empty(slots, dtype=torch.int64, device=flat.device)
    inverse = torch.empty_like(order)
    tokens_per_expert = torch.empty(num_experts, dtype=torch.int64, device=flat.device)
    if slots:
        _block_counts_kernel[(blocks,)](flat, counts, slots, num_experts, BINS=bins, BLOCK=block)
        _place_kernel[(blocks,)](flat, counts, order, inverse, tokens_per_expert, slots, num_experts, blocks,
                                 BINS=bins, BLOCK=block, ROWS=32)
    else:
        tokens_per_expert.zero_()
    return order, inverse, tokens_per_expert


def count_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries name each expert (-1, absent, none); a scatter-add, because bincount on CUDA waits for the
    host."""
    flat = expert_ids.flatten()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_ids.device)
    return counts.scatter_add_(0, torch.where(flat >= 0, flat, num_experts), torch.ones_like(flat))[:num_experts]


def ranks_of_tokens(expert_ids: torch.Tensor, experts_per_rank: int, num_ranks: int) -> torch.Tensor:
    """[tokens, num_ranks] bool: whether any of the token's experts lives on the rank (expert e on rank
    e // experts_per_rank; an absent slot, -1, on none). Its column sums count the (token, rank) pairs per rank
    without waiting for the host."""
    goes_to = torch.zeros(expert_ids.shape[0], num_ranks + 1, dtype=torch.bool, device=expert_ids.device)
    return goes_to.scatter_(1, torch.where(expert_ids >= 0, expert_ids // experts_per_rank, num_ranks), True)[:, :-1]


def dedup_by_rank(expert_ids: torch.Tensor, experts_per_rank: int, goes_to: torch.Tensor, pairs: int):
    """Metadata for sending each token once per destination rank: the (token, rank) pairs of goes_to
    (ranks_of_tokens). `pairs`, their number, comes from the caller, who read it with the all-to-all's split sizes:
    counting them here, as nonzero does, would make the host wait for the GPU a second time.

    Returns (pair_token [pairs], pair_rank [pairs], pair_local_experts [pairs, top_k]): the pairs sorted by rank
    then token, and for each pair the rank-local expert ids of the token's slots on that rank (-1 for slots that
    go elsewhere).
    """
    pair_rank, pair_token = torch.nonzero_static(goes_to.T, size=pairs).unbind(1)   # rank-major order
    slot_rank = expert_ids // experts_per_rank                                      # [T, k]
    local = torch.where(slot_rank[pair_token] == pair_rank[:, None], expert_ids[pair_token] % experts_per_rank, -1)
    return pair_token, pair_rank, local


@triton.jit
def _gather_kernel(src_ptr, order_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = src[order[i] // TOP_K]"""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    token = tl.load(order_ptr + row) // TOP_K
    values = tl.load(src_ptr + token * hidden + cols, mask=cols < hidden)
    tl.store(out_ptr + row * hidden + cols, values, mask=cols < hidden)


@triton.jit
def _sum_slots_kernel(src_ptr, inverse_ptr, weights_ptr, out_ptr, hidden,
                      TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum_j w[t, j] * src[inverse[t * TOP_K + j]] (w = 1 when not WEIGHTED), fp32 accumulation;
    absent slots (inverse -1) add nothing."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(inverse_ptr + token * TOP_K + j)
        # an absent slot loads nothing; a mask of (block & scalar) fails in Triton 3.9's interpreter
        width = tl.where(row >= 0, hidden, 0)
        values = tl.load(src_ptr + row * hidden + cols, mask=cols < width, other=0.0).to(tl.float32)
        if WEIGHTED:
            values *= tl.load(weights_ptr + token * TOP_K + j).to(tl.float32)
        acc += values
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < hidden)


@triton.jit
def _combine_backward_kernel(grad_out_ptr, expert_out_ptr, order_ptr, inverse_ptr, weights_ptr, grad_expert_out_ptr,
                             grad_weights_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """For expert-order row i of slot s = order[i]: d expert_out[i] = w[s] * g[s // TOP_K] and
    d w[s] = <g[s // TOP_K], expert_out[i]>; a row of an absent slot (inverse[s] != i) gets zeros, its (undefined)
    values unread."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    slot = tl.load(order_ptr + row)
    width = tl.where(tl.load(inverse_ptr + slot) == row, hidden, 0)   # (block & scalar masks: see _sum_slots_kernel)
    grad = tl.load(grad_out_ptr + (slot // TOP_K) * hidden + cols, mask=cols < width, other=0.0).to(tl.float32)
    values = tl.load(expert_out_ptr + row * hidden + cols, mask=cols < width, other=0.0).to(tl.float32)
    weight = tl.load(weights_ptr + slot).to(tl.float32)
    tl.store(grad_expert_out_ptr + row * hidden + cols,
             (weight * grad).to(grad_expert_out_ptr.dtype.element_ty), mask=cols < hidden)
    tl.store(grad_weights_ptr + slot, tl.sum(grad * values).to(grad_weights_ptr.dtype.element_ty), mask=width > 0)


def _launch(kernel, rows: int, hidden: int, *args, **constants):
    if rows:
        kernel[(rows,)](*args, hidden, BLOCK=triton.next_power_of_2(hidden), num_warps=8 if hidden > 2048 else 4,
                        **constants)


# Custom ops with fake implementations, so that torch.compile sees each kernel as one opaque node of known
# shape and a compiled graph containing them never breaks; their gradients are registered with them.
def _gather(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[i] = x[order[i] // top_k]"""
    x = x.contiguous()
    out = x.new_empty(order.numel(), x.shape[1])
    _launch(_gather_kernel, order.numel(), x.shape[1], x, order, out, TOP_K=top_k)
    return out


dispatch_op = torch.library.custom_op("pith::dispatch", _gather, mutates_args=())


def _sum_slots(src, inverse, top_k, weights):
    """out[t] = sum_j w[t, j] * src[inverse[t * top_k + j]] (w = 1 when weights is None)."""
    src = src.contiguous()
    out = src.new_empty(inverse.numel() // top_k, src.shape[1])
    _launch(_sum_slots_kernel, out.shape[0], src.shape[1], src, inverse,
            weights.contiguous() if weights is not None else inverse, out, TOP_K=top_k, WEIGHTED=weights is not None)
    return out


def _gather_backward(grad: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    return _sum_slots(grad, inverse, top_k, None)


def _combine(expert_out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
             top_k: int) -> torch.Tensor:
    return _sum_slots(expert_out, inverse, top_k, weights)


def _combine_backward(grad: torch.Tensor, expert_out: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                      weights: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    expert_out, weights = expert_out.contiguous(), weights.contiguous()
    grad_expert_out, grad_weights = torch.empty_like(expert_out), torch.zeros_like(weights)   # absent slots: 0
    _launch(_combine_backward_kernel, order.numel(), expert_out.shape[1], grad.contiguous(), expert_out, order,
            inverse, weights, grad_expert_out, grad_weights, TOP_K=top_k)
    return grad_expert_out, grad_weights


dispatch_backward_op = torch.library.custom_op("pith::dispatch_backward", _gather_backward, mutates_args=())
combine_op = torch.library.custom_op("pith::combine", _combine, mutates_args=())
combine_backward_op = torch.library.custom_op("pith::combine_backward", _combine_backward, mutates_args=())


@dispatch_op.register_fake
def _(x, order, inverse, top_k):
    return x.new_empty(order.numel(), x.shape[1])


@dispatch_backward_op.register_fake
def _(grad, inverse, top_k):
    return grad.new_empty(inverse.numel() // top_k, grad.shape[1])


@combine_op.register_fake
def _(expert_out, weights, order, inverse, top_k):
    return expert_out.new_empty(inverse.numel() // top_k, expert_out.shape[1])


@combine_backward_op.register_fake
def _(grad, expert_out, order, inverse, weights, top_k):
    return torch.empty_like(expert_out), torch.empty_like(weights)


def _save_dispatch(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])
    ctx.top_k = inputs[3]


def _dispatch_op_backward(ctx, grad):
    return dispatch_backward_op(grad, ctx.saved_tensors[0], ctx.top_k), None, None, None


def _save_combine(ctx, inputs, output):
    expert_out, weights, order, inverse, top_k = inputs
    ctx.save_for_backward(expert_out, weights, order, inverse)
    ctx.top_k = top_k


def _combine_op_backward(ctx, grad):
    expert_out, weights, order, inverse = ctx.saved_tensors
    grad_expert_out, grad_weights = combine_backward_op(grad, expert_out, order, inverse, weights, ctx.top_k)
    return grad_expert_out, grad_weights, None, None, None


dispatch_op.register_autograd(_dispatch_op_backward, setup_context=_save_dispatch)
combine_op.register_autograd(_combine_op_backward, setup_context=_save_combine)


class _Dispatch(torch.autograd.Function):
    """The custom op's kernels without the dispatcher (~0.2 ms of CPU per custom-op call in eager code,
    which leaves the GPU idle); compiled graphs use the custom op."""

    @staticmethod
    def forward(ctx, x, order, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return _gather(x, order, inverse, top_k)

    @staticmethod
    def backward(ctx, grad):
        return _gather_backward(grad, ctx.saved_tensors[0], ctx.top_k), None, None, None


class _Combine(torch.autograd.Function):
    """As _Dispatch, for the weighted combine."""

    @staticmethod
    def forward(ctx, expert_out, weights, order, inverse, top_k):
        # the rows only for the weights' gradient: constant weights (expert parallelism's sum over ranks) keep none
        ctx.save_for_backward(expert_out if ctx.needs_input_grad[1] else None, weights, order, inverse)
        ctx.top_k = top_k
        return _combine(expert_out, weights, order, inverse, top_k)

    @staticmethod
    def backward(ctx, grad):
        expert_out, weights, order, inverse = ctx.saved_tensors
        if expert_out is None:   # each row's token's gradient times its weight (an absent slot's row: unread, as
            rows = _gather(grad, order, order, ctx.top_k) * weights.flatten()[order].unsqueeze(-1)   # past the ranges)
            return rows.to(grad.dtype), None, None, None, None
        return *_combine_backward(grad, expert_out, order, inverse, weights, ctx.top_k), None, None, None


def dispatch_reference(x, order, inverse, top_k):
    """The rows of absent slots zeros, so that no gradient goes back through them."""
    here = inverse[order] == torch.arange(order.numel(), device=order.device)
    return torch.where(here.unsqueeze(-1), x.index_select(0, order // top_k), 0)


def combine_reference(expert_out, weights, inverse, top_k):
    """The rows of absent slots unread: torch.where, as undefined values times 0 could be NaN."""
    slots = expert_out.index_select(0, inverse.clamp(min=0)).unflatten(0, (-1, top_k)).float()
    slots = torch.where((inverse >= 0).view(*weights.shape, 1), slots * weights.float().unsqueeze(-1), 0)
    return slots.sum(1).to(expert_out.dtype)


def dispatch_tokens(x, order, inverse, top_k, use_kernel=None):
    """x [tokens, hidden] -> [order's slots, hidden], row i holding the token of slot order[i] (the kernel: for an
    absent slot too, its row never read; the reference: zeros)."""
    if use_kernel if use_kernel is not None else x.is_cuda:
        return (dispatch_op if torch.compiler.is_compiling() else _Dispatch.apply)(x, order, inverse, top_k)
    return dispatch_reference(x, order, inverse, top_k)


def combine_tokens(expert_out, weights, order, inverse, top_k, use_kernel=None):
    """expert_out [slots, hidden] in expert order, weights [tokens, top_k] -> [tokens, hidden]:
    each token's expert outputs times its routing weights, summed in fp32 (absent slots, inverse -1, skipped)."""
    if use_kernel if use_kernel is not None else expert_out.is_cuda:
        return (combine_op if torch.compiler.is_compiling() else _Combine.apply)(expert_out, weights, order, inverse,
                                                                                 top_k)
    return combine_reference(expert_out, weights, inverse, top_k)
