"""Context parallelism: each sequence split over the cp ranks in the zigzag layout, and causal ring attention.

A sequence of length S is cut into 2cp chunks of S / 2cp tokens; cp rank r holds chunks r and 2cp-1-r, one
early and one late, so that every rank has the same share of the causal attention's work. The data, the
labels and the rotary positions of a rank all follow that layout (`zigzag_positions`, `zigzag_part`).

`ring_attention` computes a rank's queries against the keys and values of the whole sequence: the rank's own
block first, then cp - 1 times the block its ring predecessor held, passed on around the ring; the pass of the
next block is in flight while the current one is computed. Each block returns its output and its log-sum-exp
(lse); the blocks are merged by lse, so the result is the full-sequence attention's. What travels is whatever
the caller's `expand` turns into keys and values (GQA's key-value heads, or MLA's compressed latent), and in the
backward each block's gradient goes back to the rank it came from the way it came, each exchange in flight while
the backward of the block before it is computed.

A recurrence along the sequence whose carry out of a chunk is affine in the carry into it (the gated delta rule's
state) runs every chunk at once: each rank gives its chunks' affine maps, every rank scans all 2cp of them
(`zigzag_affine_carries`), and each chunk corrects its result for the carry it really starts from.
"""
import functools

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from pith_engine.parallel import LayoutError


def zigzag_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions in the full sequence of the `seq` tokens cp rank `rank` holds: chunks rank and 2cp-1-rank
    of the full sequence (cp * seq tokens), in that order."""
    chunk = seq // 2
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def zigzag_part(tokens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Of tokens [batch, seq, ...] (whole sequences), the columns cp rank `rank` holds."""
    seq = tokens.shape[1]
    if seq % (2 * cp):
        raise LayoutError(f"sequence length {seq} must be a multiple of 2 x cp = {2 * cp} (the zigzag split of "
                          f"context parallelism); choose --seq-len {seq + 2 * cp - seq % (2 * cp)} or another --cp")
    return tokens[:, zigzag_positions(seq // cp, cp, rank, tokens.device)]


def block_attention(q, k, v, q_positions, k_positions, scale: float, window: int | None = None, block_mask=None):
    """(out [batch, heads, q_len, dim], lse [batch, heads, q_len] fp32) of q against one block of k and v (their
    heads a divisor of q's: GQA), query i seeing key j when 0 <= position_i - position_j (< window). A query
    that sees no key of the block has out 0 and lse -inf. With block_mask (the same visibility as a
    flex_attention BlockMask: `zigzag_block_mask`) compiled flex_attention, which never holds the scores whole
    and skips the masked tiles; without, the scores are materialized (the CPU path: flex has no CPU backward)."""
    if block_mask is not None:
        out, aux = _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                                    return_aux=AuxRequest(lse=True))
        return out, aux.lse
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    offset = q_positions[:, None] - k_positions[None, :]
    seen = (offset >= 0) & (offset < window) if window else offset >= 0
    scores = (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return (probs @ v.float()).to(q.dtype), lse


def block_seen(seq: int, cp: int, rank: int, source: int, window: int | None) -> bool:
    """Whether any query of cp rank `rank` sees any key of cp rank `source` (seq tokens each, zigzag), from the
    chunks' bounds: offsets of a query chunk at a and a key chunk at b span a - b - (c - 1) .. a - b + (c - 1)."""
    chunk = seq // 2
    starts = [[r * chunk, (2 * cp - 1 - r) * chunk] for r in (rank, source)]
    return any(a - b + chunk - 1 >= 0 and (window is None or a - b - (chunk - 1) < window)
               for a in starts[0] for b in starts[1])


@functools.cache
def _compiled_flex():
    """flex_attention is only fast compiled; compiled on first use, not at import (that would import inductor)."""
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_merge():
    return torch.compile(_merge, dynamic=False)


@functools.lru_cache(maxsize=64)
def zigzag_block_mask(seq: int, cp: int, rank: int, source: int, window: int | None, device: str):
    """The flex_attention BlockMask of cp rank `rank`'s queries against the keys cp rank `source` holds (seq
    tokens each, zigzag): the same for every layer and step of a run, so made once."""
    q_positions, k_positions = (zigzag_positions(seq, cp, r, device) for r in (rank, source))

    def visible(batch, head, q_index, kv_index):
        offset = q_positions[q_index] - k_positions[kv_index]
        return (offset >= 0) & (offset < window) if window else offset >= 0
    return create_block_mask(visible, None, None, seq, seq, device=device)


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over all the blocks from each block's (out, lse): outputs weighted by exp(lse_i - lse). On
    CUDA fused by the compiler: eager, it took 2.4 of a rank's 25.9 ms at 32k tokens over cp 4 on the H200
    (bench/RESULTS.md)."""
    return (_compiled_merge() if outs[0].is_cuda else _merge)(outs, lses)


def _merge(outs, lses):
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(part - lse).unsqueeze(-1) * block.float() for block, part in zip(outs, lses))
    return out.to(outs[0].dtype), lse


def ring_attention(q, payload: tuple, group, scale: float, window: int | None = None, expand=None):
    """(out, lse) of this cp rank's queries q [batch, heads, seq, dim] (zigzag layout) against the whole
    sequence's keys and values. payload: this rank's (k, v), or the tensors from which expand(*payload) makes
    them; what travels around the ring. Blocks no query can see (outside every window) are passed on without
    being computed."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = q.shape[2]
    q_positions = zigzag_positions(seq, cp, rank, q.device)
    outs, lses = [], []
    for step in range(cp):
        passing = _launch_pass(payload, group) if step < cp - 1 else None
        if passing is not None:
            returned = {}   # the backward's exchange of this pass, from _Received's backward to _Sent's
            token = _Sent.apply(returned, *payload)
        source = (rank - step) % cp
        if block_seen(seq, cp, rank, source, window):
            k, v = expand(*payload) if expand else payload
            mask = zigzag_block_mask(seq, cp, rank, source, window, str(q.device)) if q.is_cuda else None
            out, lse = block_attention(q, k, v, q_positions, zigzag_positions(seq, cp, source, q.device), scale,
                                       window, mask)
            outs.append(out)
            lses.append(lse)
        if passing is not None:
            payload = _Received.apply(returned, group, token, *_wait(*passing))
    out, lse = merge_blocks(outs, lses)
    return _Tie.apply(out, *payload), lse


def _neighbours(group) -> tuple[int, int]:
    """The global ranks of this rank's ring predecessor and successor in `group`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    return dist.get_global_rank(group, (rank - 1) % cp), dist.get_global_rank(group, (rank + 1) % cp)


def _exchange(sent: list[torch.Tensor], to: int, received: list[torch.Tensor], source: int, group):
    ops = [dist.P2POp(dist.isend, t.contiguous(), to, group) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, source, group) for t in received]
    return dist.batch_isend_irecv(ops)


def _launch_pass(payload: tuple, group):
    """Send this rank's payload on to its successor and receive its predecessor's; (works, buffers)."""
    before, after = _neighbours(group)
    buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in payload]
    return _exchange([t.detach() for t in payload], after, buffers, before, group), buffers


def _wait(works, buffers):
    for work in works:
        work.wait()
    return buffers


class _Sent(torch.autograd.Function):
    """The tensors a ring pass sends, as a token for _Received: made before the block computed with them, so that
    in the backward, which runs nodes latest-made first, this waits for their gradients (sent back by the
    successor, which received them) only after that block's backward has run, while the exchange was in flight."""

    @staticmethod
    def forward(ctx, returned, *sent):
        ctx.returned = returned
        return sent[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return None, *_wait(*ctx.returned.pop("pass"))


class _Received(torch.autograd.Function):
    """The tensors a ring pass brought from the predecessor, joined to the graph through the token of those this
    rank sent (_Sent): the backward launches the exchange that returns the received tensors' gradients to the
    predecessor and takes those of the sent ones from the successor; _Sent's backward waits for it."""

    @staticmethod
    def forward(ctx, returned, group, token, *received):
        ctx.returned, ctx.group = returned, group
        return tuple(t.view_as(t) for t in received)

    @staticmethod
    def backward(ctx, *grads):
        before, after = _neighbours(ctx.group)
        sent_grads = [torch.empty_like(g, memory_format=torch.contiguous_format) for g in grads]
        ctx.returned["pass"] = (_exchange(list(grads), before, sent_grads, after, ctx.group), sent_grads)
        return None, None, grads[0].new_empty(0), *(None for _ in grads)


class _Tie(torch.autograd.Function):
    """out, with `others` in its graph: the last block received reaches the backward even where no query saw it
    (a sliding window), so that every rank takes part in each pass's backward exchange."""

    @staticmethod
    def forward(ctx, out, *others):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, *(None for _ in ctx.needs_input_grad[1:])


def zigzag_chunks(group) -> tuple[int, int]:
    """The sequence indices of this cp rank's two zigzag chunks: r and 2cp-1-r."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    return rank, 2 * cp - 1 - rank


def zigzag_gather(parts: tuple, group) -> list:
    """Every zigzag chunk's tensor in sequence order, gathered from each cp rank's two (parts: chunk r's and chunk
    2cp-1-r's, shaped alike on every rank). The backward sums each chunk's gradient over the ranks that used it and
    hands it to the rank that gave the chunk."""
    cp = dist.get_world_size(group)
    every = _GatherAll.apply(torch.stack(parts), group)   # [cp, 2, ...]
    return [every[c, 0] if c < cp else every[2 * cp - 1 - c, 1] for c in range(2 * cp)]


def zigzag_previous(parts: tuple, group) -> list:
    """For each of this rank's two zigzag chunks, the tensor the chunk before it gave (parts as for zigzag_gather);
    None for the sequence's first chunk."""
    every = zigzag_gather(parts, group)
    return [every[chunk - 1] if chunk else None for chunk in zigzag_chunks(group)]


def zigzag_affine_carries(maps: tuple, width: int, group) -> list:
    """For a recurrence whose carry after a chunk is affine in the carry before it, out = A @ in + B, starting from
    zeros: the carries into this rank's two zigzag chunks. maps: this rank's chunks' [B | A], each [..., n, width +
    n] (B [..., n, width], A [..., n, n]). Every rank gathers all chunks' maps and runs the 2cp-step scan itself,
    so no rank waits for another's chunk to finish."""
    carry, carries = None, []
    for chunk in zigzag_gather(maps, group):
        offset, transition = chunk.split([width, chunk.shape[-1] - width], dim=-1)
        carries.append(torch.zeros_like(offset) if carry is None else carry)
        carry = transition @ carries[-1] + offset
    return [carries[chunk] for chunk in zigzag_chunks(group)]


class _GatherAll(torch.autograd.Function):
    """[cp, *x.shape]: x of every rank of the group; the backward sums the gradient over the ranks and returns this
    rank's slice of it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        every = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, x.contiguous(), group=group)
        return torch.stack(every)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None
