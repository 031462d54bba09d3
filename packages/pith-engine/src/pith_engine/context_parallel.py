"""Context parallelism: each sequence split over the cp ranks in the zigzag layout, and causal ring attention.

A sequence of length S is cut into 2cp chunks of S / 2cp tokens; cp rank r holds chunks r and 2cp-1-r, one
early and one late, so that every rank has the same share of the causal attention's work. The data, the
labels and the rotary positions of a rank all follow that layout (`zigzag_positions`, `zigzag_part`).

`ring_attention` computes a rank's queries against the keys and values of the whole sequence: the rank's own
block first, then cp - 1 times the block its ring predecessor held, passed on around the ring; the pass of the
next block is in flight while the current one is computed. Each block returns its output and its log-sum-exp
(lse); the blocks are merged by lse, so the result is the full-sequence attention's. What travels is whatever
the caller's `expand` turns into keys and values (GQA's key-value heads, or MLA's compressed latent); under a
sliding window shorter than a chunk, only the keys another rank can see. A rank keeps for the backward only its
own share: its queries, its payload, the merged output and lse. The backward passes the payload around the ring
again, computes each block's forward again and back-propagates the merge's gradient into it; the gradients of
each payload travel with it, gathering each rank's part, back to their owner; every exchange but the last of the
backward is in flight while a block is computed.

A recurrence along the sequence whose carry out of a chunk is affine in the carry into it (the gated delta rule's
state) runs every chunk at once: each rank gives its chunks' affine maps, every rank scans all 2cp of them
(`zigzag_affine_carries`), and each chunk corrects its result for the carry it really starts from.
"""
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from pith_engine.parallel import LayoutError


def zigzag_positions(seq: int, cp: int, rank: int, device=None, tail: int | None = None) -> torch.Tensor:
    """The positions in the full sequence of the `seq` tokens cp rank `rank` holds: chunks rank and 2cp-1-rank
    of the full sequence (cp * seq tokens), in that order; tail: only the last `tail` of each chunk."""
    chunk = seq // 2
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    skipped = 0 if tail is None else chunk - tail
    return torch.cat([torch.arange(first + skipped, first + chunk, device=device),
                      torch.arange(second + skipped, second + chunk, device=device)])


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
def zigzag_block_mask(seq: int, cp: int, rank: int, source: int, window: int | None, device: str,
                      tail: int | None = None):
    """The flex_attention BlockMask of cp rank `rank`'s queries against the keys cp rank `source` holds (seq
    tokens each, zigzag; tail: only the last `tail` of each chunk): the same for every layer and step of a run,
    so made once."""
    q_positions = zigzag_positions(seq, cp, rank, device)
    k_positions = zigzag_positions(seq, cp, source, device, tail)

    def visible(batch, head, q_index, kv_index):
        offset = q_positions[q_index] - k_positions[kv_index]
        return (offset >= 0) & (offset < window) if window else offset >= 0
    return create_block_mask(visible, None, None, seq, len(k_positions), device=device)


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
    them, each [..., seq, features]; what travels around the ring. Blocks no query sees (outside every window) are
    not computed, forward or backward.

    The backward keeps this rank's share of the sequence only: q, the payload, out and lse. It passes the payload
    around the ring again and computes each block's forward again, and `expand` with it: expand must compute with
    the tensors it computed with in the forward (close over its weights where a wrapper swaps a module's parameters
    after the forward, as ComputeCasts does). Their gradients reach them through a backward nested in this one (as
    in torch.utils.checkpoint's reentrant variant): into .grad, or through a compute copy's backward."""
    ring = _Ring(group, dist.get_world_size(group), dist.get_rank(group), q.shape[2], scale, window, expand)
    return _RingAttention.apply(q, ring, *payload)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """One ring attention call's settings and this rank's place in the ring."""
    group: object
    cp: int
    rank: int
    seq: int
    scale: float
    window: int | None
    expand: object

    @property
    def tail(self) -> int | None:
        """How many of each chunk's last tokens travel: under a sliding window shorter than a chunk, another rank's
        queries (those of a later chunk) see at most the last window - 1 keys of a chunk (one at least: no pass is
        empty); None: all of them."""
        chunk = self.seq // 2
        return max(self.window - 1, 1) if self.window and self.window - 1 < chunk else None

    def travelling(self, payload) -> list:
        """The part of this rank's payload that goes around the ring."""
        tail = self.tail
        return list(payload) if tail is None else [t.unflatten(-2, (2, -1))[..., -tail:, :].flatten(-3, -2)
                                                   for t in payload]

    def add_travelled(self, grads: list, travelled: list):
        """Add the gradients of this rank's travelling payload (back from the ring) into those of its whole payload."""
        for grad, part in zip(grads, travelled):
            if self.tail is None:
                grad.add_(part)
            else:
                grad.unflatten(-2, (2, -1))[..., -self.tail:, :].add_(part.unflatten(-2, (2, -1)))

    def sees(self, source: int) -> bool:
        return block_seen(self.seq, self.cp, self.rank, source, self.window)

    def attend(self, q, held, source: int):
        """(out, lse) of q against the payload `held` of rank `source`: its whole payload if this rank's, else the
        part that travelled."""
        tail = None if source == self.rank else self.tail
        k, v = self.expand(*held) if self.expand else held
        mask = (zigzag_block_mask(self.seq, self.cp, self.rank, source, self.window, str(q.device), tail)
                if q.is_cuda else None)
        return block_attention(q, k, v, zigzag_positions(self.seq, self.cp, self.rank, q.device),
                               zigzag_positions(self.seq, self.cp, source, q.device, tail), self.scale, self.window,
                               mask)

    def block_grads(self, q, held, source: int, grad_out, lse, offset) -> list:
        """The gradients of `held` (rank source's payload) through q's attention to it, q's added into q.grad: the
        block's forward again, with autograd, and its part of the merge's gradient back-propagated into it. Per
        query, with w = exp(lse_block - lse) its weight in the merge (out = sum of w * out_block, lse = logsumexp of
        lse_block): out_block's gradient is w * grad_out, lse_block's w * (<grad_out, out_block> - offset), where
        offset = <grad_out, out> - grad_lse."""
        leaves = [t.detach().requires_grad_() for t in held]
        with torch.enable_grad():
            out, block_lse = self.attend(q, leaves, source)
            weight = torch.exp(block_lse.detach() - lse)
            torch.autograd.backward((out, block_lse), (
                (weight.unsqueeze(-1) * grad_out).to(out.dtype),
                weight * ((grad_out.float() * out.detach().float()).sum(-1) - offset)))
        return [leaf.grad for leaf in leaves]


class _RingAttention(torch.autograd.Function):
    """ring_attention (see there): the forward passes the payload on while it computes the block it holds; the
    backward passes it on again, and with it the gradients gathered for it."""

    @staticmethod
    def forward(ctx, q, ring: _Ring, *payload):
        outs, lses, held, passed = [], [], payload, ring.travelling(payload)
        for step in range(ring.cp):
            passing = _launch_pass(passed, ring.group) if step < ring.cp - 1 else None
            source = (ring.rank - step) % ring.cp
            if ring.sees(source):
                out, lse = ring.attend(q, held, source)
                outs.append(out)
                lses.append(lse)
            if passing is not None:
                held = passed = _wait(*passing)
        out, lse = merge_blocks(outs, lses)
        ctx.ring = ring
        ctx.save_for_backward(q, out, lse, *payload)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, out, lse, *payload = ctx.saved_tensors
        ring = ctx.ring
        q = q.detach().requires_grad_()   # each block's backward adds its part of q's gradient into q.grad
        offset = (grad_out.float() * out.float()).sum(-1) - grad_lse
        held, gathered, own = ring.travelling(payload), [], None
        for step in range(ring.cp):
            # one batch a step, alike on every rank: the payload held passed on (but at the last step) and, from the
            # third step, the gradients gathered for the one held in the step before. A payload's gradients start at
            # its owner's successor (the owner keeps its own block's) and reach the owner after the last step.
            onward = held if step < ring.cp - 1 else []
            sent = [*onward, *(gathered if step >= 2 else [])]
            passing = _launch_pass(sent, ring.group) if sent else None
            source = (ring.rank - step) % ring.cp
            grads = ring.block_grads(q, held if step else payload, source, grad_out, lse, offset) \
                if ring.sees(source) else None
            received = _wait(*passing) if passing is not None else []
            if step == 0:
                own = grads
            elif step == 1:
                gathered = grads or [torch.zeros_like(t) for t in held]
            else:
                gathered = received[len(onward):]
                for total, grad in zip(gathered, grads or []):
                    total.add_(grad)
            held = received[:len(onward)]
        if ring.cp > 1:   # the last gradients gathered on to their owner, the successor; this rank's come back
            ring.add_travelled(own, _wait(*_launch_pass(gathered, ring.group)))
        return q.grad, None, *own


def _neighbours(group) -> tuple[int, int]:
    """The global ranks of this rank's ring predecessor and successor in `group`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    return dist.get_global_rank(group, (rank - 1) % cp), dist.get_global_rank(group, (rank + 1) % cp)


def _exchange(sent: list[torch.Tensor], to: int, received: list[torch.Tensor], source: int, group):
    ops = [dist.P2POp(dist.isend, t.contiguous(), to, group) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, source, group) for t in received]
    return dist.batch_isend_irecv(ops)


def _launch_pass(tensors: list, group):
    """Send `tensors` on to this rank's successor and receive its predecessor's, shaped alike; (works, buffers)."""
    before, after = _neighbours(group)
    buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _exchange([t.detach() for t in tensors], after, buffers, before, group), buffers


def _wait(works, buffers):
    for work in works:
        work.wait()
    return buffers


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
