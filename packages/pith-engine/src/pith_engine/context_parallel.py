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


def zigzag_scan(step, parts: tuple, carry: torch.Tensor, group) -> tuple:
    """A recurrence over the whole sequence under the zigzag layout: step(part, carry) -> (out, carry) run on the
    sequence's 2cp chunks in order, where this cp rank holds parts = (chunk r, chunk 2cp-1-r). A chunk's carry in
    is the carry out of the chunk before it, handed over by that chunk's rank: rank r-1 for an early chunk, rank
    r+1 for a late one, the turn at rank cp-1 local. The ranks therefore run one after another, 0 to cp-1 and back
    (a V), forward and, in reverse, backward. carry: the first chunk's (the same shape as every carry). Returns the
    two parts' outputs."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    peer = functools.partial(dist.get_global_rank, group)
    anchor = parts[0].flatten()[:0]   # joins a received carry to the graph, so that its backward sends the gradient
    handed = []
    if rank > 0:
        carry = _Handed.apply(anchor, carry, peer(rank - 1))
    first, carry = step(parts[0], carry)
    if rank < cp - 1:
        handed.append(_Handing.apply(carry, peer(rank + 1)))
        carry = _Handed.apply(anchor, carry, peer(rank + 1))
    second, carry = step(parts[1], carry)
    if rank > 0:
        handed.append(_Handing.apply(carry, peer(rank - 1)))
    return first, _Join.apply(second, *handed)


class _Handing(torch.autograd.Function):
    """Sends a carry to the next chunk's rank; the backward receives its gradient from there. Returns an empty
    token for _Join: made after this rank's chunk, so the backward, latest-made first, waits for the gradient only
    after the later chunk's backward has run."""

    @staticmethod
    def forward(ctx, carry, to):
        ctx.to, ctx.like = to, carry.detach()
        dist.send(carry.detach().contiguous(), to)
        return carry.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grad = torch.empty_like(ctx.like, memory_format=torch.contiguous_format)
        dist.recv(grad, ctx.to)
        return grad, None


class _Handed(torch.autograd.Function):
    """The carry received from the previous chunk's rank (shaped like `like`); the backward sends its gradient
    back there. `anchor`, an empty slice of this rank's input, puts it in the graph."""

    @staticmethod
    def forward(ctx, anchor, like, source):
        ctx.source = source
        received = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.recv(received, source)
        return received

    @staticmethod
    def backward(ctx, grad):
        dist.send(grad.contiguous(), ctx.source)
        return grad.new_empty(0), None, None


class _Join(torch.autograd.Function):
    """out, with the _Handing tokens in its graph, so that every hand-over takes part in the backward."""

    @staticmethod
    def forward(ctx, out, *tokens):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, *(grad.new_empty(0) for _ in ctx.needs_input_grad[1:])
