"""Ring attention over the zigzag layout (pith_engine.context_parallel) on gloo processes against the attention of
the whole sequence on one: each rank's outputs, log-sum-exps and gradients are those of its positions; the scan
of affine carries over the zigzag chunks against the same scan on one process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import relative_error
from distributed import run_on_processes
from pith_engine.context_parallel import (block_attention, block_seen, merge_blocks, ring_attention,
                                          zigzag_affine_carries, zigzag_block_mask, zigzag_part, zigzag_positions)
from pith_engine.parallel import LayoutError

SEQ, HEADS, KV_HEADS, DIM, LATENT = 32, 4, 2, 8, 6


def inputs(seq: int = SEQ, dim: int = DIM, device: str = "cpu"):
    generator = torch.Generator(device).manual_seed(3)
    q = torch.randn(2, HEADS, seq, dim, generator=generator, device=device)
    latent = torch.randn(2, seq, LATENT, generator=generator, device=device)   # MLA-like: keys and values made from it
    up = torch.randn(LATENT, 2 * KV_HEADS * dim, generator=generator, device=device) / LATENT ** 0.5
    weight = torch.randn(2, HEADS, seq, dim, generator=generator, device=device)   # loss: sum(out * weight) + sum(lse)
    return q, latent, up, weight


def expand(latent, up):
    """[batch, seq, latent] -> k, v [batch, kv_heads, seq, dim]."""
    k, v = (latent @ up).unflatten(-1, (2, KV_HEADS, -1)).permute(2, 0, 3, 1, 4)
    return k, v


def attention_and_grads(tensors, weight, attend):
    """out, lse and the gradients of `tensors` for the loss sum(out * weight) + sum(lse)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = attend(*leaves)
    ((out * weight).sum() + lse[lse > float("-inf")].sum()).backward()
    return out, lse, *(leaf.grad for leaf in leaves)


def ring_body(rank, world, window, seq=SEQ, dim=DIM, device="cpu", tolerance=1e-5):
    q, latent, up, weight = inputs(seq, dim, device)
    k, v = expand(latent, up)
    positions, mine = torch.arange(seq, device=device), zigzag_positions(seq // world, world, rank, device)
    scale, group = dim ** -0.5, dist.group.WORLD

    def whole(q, k, v):   # the attention of the whole sequence on one process
        return block_attention(q, k, v, positions, positions, scale, window)
    # the latent travels, expanded on each rank: out, lse, and the gradients of q, latent and the expanding weight
    expected = attention_and_grads((q, latent, up), weight, lambda q, latent, up: whole(q, *expand(latent, up)))
    actual = attention_and_grads((q[:, :, mine], latent[:, mine], up), weight[:, :, mine], lambda q, latent, up:
                                 ring_attention(q, (latent,), group, scale, window, lambda latent: expand(latent, up)))
    dist.all_reduce(actual[-1])   # each rank's share of the shared weight's gradient
    wanted = [t[:, :, mine] for t in expected[:3]] + [expected[3][:, mine], expected[4]]
    for name, got, want in zip(["out", "lse", "q", "latent", "up"], actual, wanted):
        assert relative_error(got, want) < tolerance, (rank, world, window, name)
    # the keys and values travel: out, lse, and the gradients of q, k and v (each [batch, heads, seq, ...])
    expected = attention_and_grads((q, k, v), weight, whole)
    actual = attention_and_grads((q[:, :, mine], k[:, :, mine], v[:, :, mine]), weight[:, :, mine],
                                 lambda q, k, v: ring_attention(q, (k, v), group, scale, window))
    for name, got, want in zip(["out", "lse", "q", "k", "v"], actual, expected):
        assert relative_error(got, want[:, :, mine]) < tolerance, (rank, world, window, name)


class _StagedWork:
    """A gloo exchange of CPU copies whose wait also copies what arrived into the GPU's receive buffers."""

    def __init__(self, works, arrived, buffers):
        self.works, self.arrived, self.buffers = works, arrived, buffers

    def wait(self):
        for work in self.works:
            work.wait()
        for buffer, part in zip(self.buffers, self.arrived):
            buffer.copy_(part)


def cuda_ring_body(rank, world, windows):
    """ring_body on the one GPU every rank shares, each exchange staged through the CPU (gloo sends CPU tensors)."""
    from pith_engine import context_parallel
    exchange = context_parallel._exchange

    def staged(sent, to, received, source, group):
        arrived = [torch.empty(t.shape, dtype=t.dtype) for t in received]
        return [_StagedWork(exchange([t.cpu() for t in sent], to, arrived, source, group), arrived, received)]
    context_parallel._exchange = staged
    for window in windows:
        ring_body(rank, world, window, seq=1024, dim=64, device="cuda", tolerance=1e-3)


def affine_carries_body(rank, world):
    generator = torch.Generator().manual_seed(4)
    maps = torch.randn(2 * world, 2, 4, 3 + 4, generator=generator, dtype=torch.float64)   # every chunk's [B | A]
    weights = torch.randn(2 * world, 2, 4, 3, generator=generator, dtype=torch.float64)
    every = maps.clone().requires_grad_()
    carry, expected = torch.zeros(2, 4, 3, dtype=torch.float64), []
    for chunk in every:   # the scan on one process
        expected.append(carry)
        carry = chunk[..., 3:] @ carry + chunk[..., :3]
    sum((c * w).sum() for c, w in zip(expected, weights)).backward()
    chunks = (rank, 2 * world - 1 - rank)
    mine = tuple(maps[c].clone().requires_grad_() for c in chunks)
    carries = zigzag_affine_carries(mine, 3, dist.group.WORLD)
    sum((carry * weights[c]).sum() for carry, c in zip(carries, chunks)).backward()   # the ranks' parts of one sum
    for carry, leaf, c in zip(carries, mine, chunks):
        assert relative_error(carry, expected[c]) < 1e-12 and relative_error(leaf.grad, every.grad[c]) < 1e-12


@pytest.mark.parametrize("cp", [2, 4])
def test_the_zigzag_scan_of_affine_carries_is_the_one_process_scan(cp):
    """Random maps [B | A] (carry out = A @ carry in + B) of the 2cp chunks, float64: each rank's two carries in
    and the gradients of its two maps (a loss summed over all ranks' carries) equal one process's scan, 1e-12."""
    run_on_processes(cp, affine_carries_body)


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_over_the_zigzag_layout_is_the_whole_sequences_attention(cp, window):
    """cp 2 and 4 (chunks of 8 and 4 tokens), causal and with sliding windows of 3 and 6 that span chunk borders
    (so some blocks are skipped at cp 4, and only each chunk's last 2 keys travel, or at cp 2 with 6 its last 5):
    out, lse and the gradients of the queries and of what travels, a latent (and the weight that expands it on
    every rank) or the keys and values themselves, within 1e-5 relative error (float32)."""
    run_on_processes(cp, ring_body, window)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward runs on CUDA (the device machine)")
@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_of_flex_blocks_on_cuda_is_the_whole_sequences_attention(cp):
    """ring_body's checks with each block through compiled flex_attention and its zigzag block mask, on one GPU
    shared by the ranks: 1024 tokens, 64 dims, causal and with a window of 64 (each chunk's last 63 keys travel,
    blocks of 126 keys), against the materialized attention of the whole sequence within 1e-3 relative error
    (float32; flex and the reference sum in other orders)."""
    run_on_processes(cp, cuda_ring_body, [None, 64])


class _Mark(torch.autograd.Function):
    """Identity on tensors that logs `name` when its forward runs and again when its backward runs."""

    @staticmethod
    def forward(ctx, events, name, *tensors):
        ctx.events, ctx.name = events, name
        events.append(name)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.events.append(ctx.name)
        return None, None, *grads


def trace_body(rank, world):
    """The order of ring passes (launch, wait) and blocks ("in": its inputs, "out": its outputs) in the forward
    and the backward of one rank."""
    from pith_engine import context_parallel
    events, exchange, wait, block = [], context_parallel._exchange, context_parallel._wait, context_parallel.block_attention
    context_parallel._exchange = lambda *args: events.append("launch") or exchange(*args)
    context_parallel._wait = lambda *args: events.append("wait") or wait(*args)
    context_parallel.block_attention = lambda q, k, v, *rest: _Mark.apply(
        events, "out", *block(*_Mark.apply(events, "in", q, k, v), *rest))
    q, latent, up, weight = inputs()
    mine = zigzag_positions(SEQ // world, world, rank)
    q, latent = q[:, :, mine].requires_grad_(), latent[:, mine].requires_grad_()
    out, lse = ring_attention(q, (latent,), dist.group.WORLD, DIM ** -0.5, expand=lambda latent: expand(latent, up))
    forward = list(events)
    (out * weight[:, :, mine]).sum().backward()
    assert forward == ["launch", "in", "out", "wait"] * (world - 1) + ["in", "out"], forward
    assert events[len(forward):] == ["launch", "in", "out", "out", "in", "wait"] * world + ["launch", "wait"], events


def test_each_ring_exchange_is_in_flight_while_a_block_is_computed_forward_and_backward():
    """cp 4: each pass of the forward is launched before the block computed meanwhile and waited for after it;
    each exchange of the backward (the payload passed on again, with the gradients gathered for the one before)
    is launched before a block's forward is computed again and back-propagated ("in", "out", "out", "in") and
    waited for after it; the last, the gradients gathered for the last block back to their owner, after all."""
    run_on_processes(4, trace_body)


def test_block_attention_is_sdpa_on_one_block_and_a_query_seeing_nothing_gets_zero():
    q, latent, up, _ = inputs()
    k, v = expand(latent, up)
    positions = torch.arange(SEQ)
    out, lse = block_attention(q, k, v, positions, positions, DIM ** -0.5)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert relative_error(out, expected) < 1e-6
    later = positions + SEQ   # keys all after every query
    out, lse = block_attention(q, k, v, positions, later, DIM ** -0.5)
    assert out.abs().max() == 0 and bool((lse == float("-inf")).all())


def test_the_zigzag_layout_gives_each_rank_an_early_and_a_late_chunk_and_a_bad_length_is_one_line():
    assert zigzag_positions(4, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(4, 2, 1).tolist() == [2, 3, 4, 5]
    tokens = torch.arange(16).view(2, 8)
    assert zigzag_part(tokens, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    with pytest.raises(LayoutError, match=r"^sequence length 10 must be a multiple of 2 x cp = 4 \(the zigzag split "
                                          r"of context parallelism\); choose --seq-len 12 or another --cp$"):
        zigzag_part(torch.zeros(1, 10), 2, 0)


@pytest.mark.parametrize("window", [None, 3, 6, 20])
def test_a_block_is_skipped_exactly_when_no_query_sees_any_of_its_keys(window):
    """block_seen (from the chunks' bounds) against every pair of positions, cp 4, chunks of 4 tokens."""
    for rank in range(4):
        for source in range(4):
            offset = zigzag_positions(8, 4, rank)[:, None] - zigzag_positions(8, 4, source)[None, :]
            seen = ((offset >= 0) & (offset < window) if window else offset >= 0).any()
            assert block_seen(8, 4, rank, source, window) == bool(seen), (rank, source, window)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward runs on CUDA (the device machine)")
@pytest.mark.parametrize("window", [None, 200])
def test_the_cuda_blocks_of_each_rank_merge_into_the_whole_sequences_attention(window):
    """cp 4 emulated on one GPU: each rank's four blocks through compiled flex_attention with its zigzag block
    mask, merged by lse, against the materialized attention of the whole sequence (1024 tokens, float32): each
    rank's out, and the gradients of q, k and v summed over the ranks, within 1e-3 relative (flex and the
    reference sum in other orders)."""
    cp, seq = 4, 1024
    generator = torch.Generator("cuda").manual_seed(2)
    q, k, v = (torch.randn(1, heads, seq, 64, device="cuda", generator=generator) for heads in (8, 2, 2))
    positions = torch.arange(seq, device="cuda")
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = block_attention(*reference, positions, positions, 0.125, window)
    expected.square().sum().backward()
    local, parts = seq // cp, [t.clone().requires_grad_() for t in (q, k, v)]
    for rank in range(cp):   # each rank's q and k, v of all: the gradients add up to the whole sequence's
        mine = zigzag_positions(local, cp, rank, "cuda")
        outs, lses = [], []
        for source in range(cp):
            if block_seen(local, cp, rank, source, window):
                theirs = zigzag_positions(local, cp, source, "cuda")
                mask = zigzag_block_mask(local, cp, rank, source, window, "cuda")
                out, lse = block_attention(parts[0][:, :, mine], parts[1][:, :, theirs], parts[2][:, :, theirs], mine,
                                           theirs, 0.125, window, mask)
                outs.append(out)
                lses.append(lse)
        out, _ = merge_blocks(outs, lses)
        assert relative_error(out, expected[:, :, mine]) < 1e-3, (rank, window)
        out.square().sum().backward()
    for name, part, whole in zip("qkv", parts, reference):
        assert relative_error(part.grad, whole.grad) < 1e-3, (name, window)
