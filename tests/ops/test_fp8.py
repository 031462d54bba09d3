"""FP8 block quantization (pith_ops.fp8): the Triton kernels (the interpreter on the CPU) against the torch
reference, and the reference against what the blocks must satisfy."""
import pytest
import torch

from conftest import KERNEL_DEVICE, relative_error
from pith_ops.grouped_gemm import grouped_linear, grouped_linear_reference
from pith_ops.fp8 import (BLOCK, E4M3_MAX, Fp8WeightCache, dequantize, fp8_linear, power_of_two_scales, quantize_blocks,
                          quantize_blocks_reference, quantize_columns, quantize_rows, quantize_rows_reference,
                          traced_fp8_linear, transposed)


def sample(rows, cols, seed=0):
    """bf16 values spanning many magnitudes, a zero row and a zero block included."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.exp(4 * torch.randn(rows, 1, generator=generator))
    x[1] = 0
    x[:BLOCK, :BLOCK] *= (torch.arange(cols)[:BLOCK] % 3 != 0)
    return x.bfloat16()


def test_scales_are_the_least_powers_of_two_that_fit_the_block_into_e4m3():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0, 3e-3, 896.0, 895.0])
    assert power_of_two_scales(amax).tolist() == [1.0, 2.0, 2.0 ** -8, torch.finfo(torch.float32).tiny, 2.0 ** -17,
                                                  2.0, 2.0]


@pytest.mark.parametrize("shape", [(64, 256), (37, 300)])
def test_the_reference_blocks_round_trip_within_e4m3s_precision(shape):
    """Each block's largest magnitude lands in (224, 448]; dequantized values are within half an e4m3 step
    (2^-4 relative) of the input, or below e4m3's smallest step there; zero blocks stay zero."""
    x = sample(*shape).float()
    for quantize, rows in ((quantize_rows_reference, 1), (quantize_blocks_reference, BLOCK)):
        q, scales = quantize(x)
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
        assert scales.shape == (-(-shape[0] // rows), -(-shape[1] // BLOCK))
        back = dequantize(q, scales, rows)
        step = scales.repeat_interleave(rows, 0).repeat_interleave(BLOCK, 1)[:shape[0], :shape[1]] * 2.0 ** -9
        assert bool(((back - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, step)).all())
        assert q.float().abs().max() <= E4M3_MAX and bool((back[1] == 0).all())
        top = q.float().abs().view(-1, 1, shape[1]).amax(dim=(1, 2)) if rows == 1 else q.float().abs().max()
        assert bool((top[top > 0] > E4M3_MAX / 2).all())


@pytest.mark.parametrize("shape", [(64, 256), (37, 300), (130, 129), (320, 256)])
def test_the_quantize_kernels_are_the_reference(shape):
    """Rows (1 x 128 blocks), columns (1 x 128 blocks of the transpose, written transposed) and 128 x 128 blocks,
    shapes that are and are not whole blocks: the same scales and e4m3 values exactly (ties to even: bf16 inputs
    over a power of two make ties common, a few percent of the values)."""
    x = sample(*shape, seed=1)
    on_kernel = x.to(KERNEL_DEVICE)
    for kernel, reference, source in ((quantize_rows, quantize_rows_reference, x),
                                      (quantize_columns, quantize_rows_reference, x.T),
                                      (quantize_blocks, quantize_blocks_reference, x)):
        q, scales = (t.cpu() for t in kernel(on_kernel))
        expected_q, expected_scales = reference(source.float())
        assert q.shape == source.shape and q.is_contiguous() and q.dtype == torch.float8_e4m3fn
        assert torch.equal(scales, expected_scales) and torch.equal(q.float(), expected_q.float())
    stack = torch.stack([x, sample(*shape, seed=2)])   # and with the transposed, in one pass, from fp32 weights too
    expected = quantize_blocks_reference(stack.float())
    for weights in (stack, x.float()[None]):
        made = quantize_blocks(weights.to(KERNEL_DEVICE), both=True)
        for got, wanted in zip(made, (expected, transposed(expected))):
            assert got[0].is_contiguous() and got[1].is_contiguous()
            assert torch.equal(got[0].cpu().float(), wanted[0][:len(weights)].float())
            assert torch.equal(got[1].cpu(), wanted[1][:len(weights)])


def quantized_reference(x, w, g):
    """The three GEMMs of a linear on the dequantized FP8 operands each reads, in fp32: out, grad_x, grad_w."""
    x_rows, g_rows = (dequantize(*quantize_rows_reference(t), 1) for t in (x, g))
    w_blocks = dequantize(*quantize_blocks_reference(w), BLOCK)
    g_columns, x_columns = (dequantize(*quantize_rows_reference(t.T), 1) for t in (g, x))
    return x_rows @ w_blocks.T, g_rows @ w_blocks, g_columns @ x_columns.T


@pytest.mark.parametrize("copy", [False, True])
def test_the_fp8_linear_is_the_gemms_of_its_dequantized_operands(copy):
    """Forward, input and weight gradients against fp32 GEMMs of the dequantized blocks each GEMM reads (within
    5e-3 relative, 1.7e-3 seen: the bf16 outputs round to 2^-8; on CUDA scaled_mm sums in another order) and
    against the unquantized linear (within 5e-2, 3.8e-2 seen: e4m3 keeps 4 significant bits). copy: a bf16
    compute copy naming its fp32 master (grad_into) gets the weight gradient in the master's .grad."""
    torch.manual_seed(4)
    x = (torch.randn(2, 192, 256) * 3).bfloat16().to(KERNEL_DEVICE).requires_grad_()
    master = torch.nn.Parameter(torch.randn(320, 256, device=KERNEL_DEVICE) / 16)
    weight = master
    if copy:
        weight = master.detach().bfloat16().requires_grad_()
        weight.grad_into = master
    g = torch.randn(2, 192, 320).bfloat16().to(KERNEL_DEVICE)
    out = fp8_linear(x, weight, Fp8WeightCache())
    out.backward(g)
    assert out.dtype == torch.bfloat16 and (not copy or weight.grad is None)
    expected = quantized_reference(x.detach().flatten(0, 1).float(), weight.detach().float(), g.flatten(0, 1).float())
    exact = (x.detach().float().flatten(0, 1) @ weight.detach().float().T, g.flatten(0, 1).float() @ weight.detach().float(),
             g.flatten(0, 1).float().T @ x.detach().float().flatten(0, 1))
    for name, got, wanted, unquantized in zip(("out", "grad_x", "grad_w"), (out, x.grad, master.grad), expected, exact):
        assert relative_error(got.flatten(0, -2).float(), wanted) < 5e-3, name
        assert relative_error(got.flatten(0, -2).float(), unquantized) < 5e-2, name
    assert master.grad.dtype == torch.float32


def linear_inputs(seed):
    """bf16 x [2, 100, 256] (200 tokens: not whole blocks), weight [320, 256] (320 rows: not whole blocks), g."""
    torch.manual_seed(seed)
    x = (torch.randn(2, 100, 256) * 3).bfloat16().to(KERNEL_DEVICE).requires_grad_()
    weight = torch.nn.Parameter((torch.randn(320, 256) / 16).bfloat16().to(KERNEL_DEVICE))
    return x, weight, torch.randn(2, 100, 320).bfloat16().to(KERNEL_DEVICE)


def test_the_traced_fp8_linear_is_the_eager_one():
    """The custom op (pith::fp8_linear, its backward pith::fp8_linear_backward) against fp8_linear, under mixed
    precision (a bf16 compute copy of an fp32 master): the output and input gradient the same exactly (the same
    blocks, the same GEMMs); the weight gradient, which fp8_linear adds into the master's fp32 .grad, returned to
    autograd in the copy's bf16 and reaching the master through the cast: within 4e-3 relative (bf16 rounds each
    element to 2^-9; 1.7e-3 seen). The blocks it keeps for the backward (the input's along the tokens, the weight's
    transposed, quantized with its forward blocks in one pass) are no gradient's."""
    x, weight, g = linear_inputs(7)
    master = torch.nn.Parameter(weight.detach().float())
    copy = master.detach().bfloat16().requires_grad_()
    copy.grad_into = master
    results = []
    for linear in (lambda: fp8_linear(x, copy, Fp8WeightCache()), lambda: traced_fp8_linear(x, master.bfloat16())):
        x.grad = master.grad = None
        out = linear()
        out.backward(g)
        results.append((out, x.grad, master.grad))
    (out, grad_x, grad_w), (traced_out, traced_grad_x, traced_grad_w) = results
    assert torch.equal(traced_out, out) and torch.equal(traced_grad_x, grad_x) and copy.grad is None
    assert traced_grad_w.dtype == torch.float32 and relative_error(traced_grad_w, grad_w) < 4e-3
    _, *kept = torch.ops.pith.fp8_linear(x, copy)
    assert [t.dtype for t in kept] == [torch.float8_e4m3fn, torch.float32] * 2 and not any(t.requires_grad for t in kept)
    assert [tuple(t.shape) for t in kept[2:]] == [(256, 320), (2, 3)]   # the weight's transposed blocks, its scales


def fp8_mlp(x, w1, w2):
    return traced_fp8_linear(torch.nn.functional.silu(traced_fp8_linear(x, w1)), w2)


def test_the_traced_fp8_linear_compiles_in_one_graph_and_matches_eager():
    """torch.compile(fullgraph=True) of two FP8 linears around a SiLU: one graph, no break (explain), and the
    compiled forward and backward are eager's within 1e-2 relative (the same custom ops; inductor's SiLU may round
    its bf16 output differently, which moves a block's FP8 values; exact here), where the FP8 output is 5.3e-2 from
    the fp32 one without quantization (e4m3 keeps 4 significant bits)."""
    torch._dynamo.reset()
    x, w1, g = linear_inputs(8)
    w2 = torch.nn.Parameter((torch.randn(320, 320) / 16).bfloat16().to(KERNEL_DEVICE))
    explained = torch._dynamo.explain(fp8_mlp)(x, w1, w2)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    results = []
    for fn in (fp8_mlp, torch.compile(fp8_mlp, fullgraph=True, dynamic=False)):
        for t in (x, w1, w2):
            t.grad = None
        out = fn(x, w1, w2)
        out.backward(g)
        results.append([out, x.grad, w1.grad, w2.grad])
    for name, eager, graph in zip(("out", "grad_x", "grad_w1", "grad_w2"), *results):
        assert relative_error(graph.float(), eager.float()) < 1e-2, name
    unquantized = torch.nn.functional.silu(x.detach().float() @ w1.detach().float().T) @ w2.detach().float().T
    assert relative_error(results[1][0].float(), unquantized) > 1e-2


def test_the_weight_cache_quantizes_each_weight_once_per_step_and_never_serves_a_stale_one():
    """Three micro-batches' forwards and backwards quantize each of two weights once; after an optimizer step the
    next forward quantizes again and computes with the updated weight; a queued weight gradient waits."""
    torch.manual_seed(5)
    weights = [torch.nn.Parameter(torch.randn(128, 128, device=KERNEL_DEVICE)) for _ in range(2)]
    optimizer = torch.optim.SGD(weights, lr=1.0)
    cache, queue = Fp8WeightCache().watch(optimizer), []
    x = torch.randn(4, 128, device=KERNEL_DEVICE).bfloat16()
    for _ in range(3):
        fp8_linear(fp8_linear(x, weights[0], cache), weights[1], cache, queue).float().sum().backward()
    assert cache.quantized == 2 and weights[1].grad is None and len(queue) == 3
    for closure in queue:
        closure()
    optimizer.step()
    assert not cache.copies
    after = fp8_linear(x, weights[0], cache)
    assert cache.quantized == 3
    assert torch.equal(after, fp8_linear(x, weights[0], Fp8WeightCache()))


def test_a_cache_that_keeps_nothing_quantizes_at_each_use_the_blocks_a_kept_one_serves():
    """keep=False (weights FSDP2 gathers for each use): a forward and its backward quantize the weight twice (its
    blocks, then the transposed ones), hold nothing, and compute exactly what the kept cache computes."""
    torch.manual_seed(6)
    weight = torch.nn.Parameter(torch.randn(256, 128, device=KERNEL_DEVICE))
    x = torch.randn(4, 128, device=KERNEL_DEVICE).bfloat16().requires_grad_()
    results = []
    for cache in (Fp8WeightCache(), Fp8WeightCache(keep=False)):
        weight.grad = x.grad = None
        out = fp8_linear(x, weight, cache)
        out.float().square().sum().backward()
        results.append((cache, out, x.grad, weight.grad))
    (kept, *expected), (unkept, *got) = results
    assert kept.quantized == 1 and len(kept.copies) == 1 and unkept.quantized == 2 and not unkept.copies
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("kernel,k", [(False, 160), (True, 160), (True, 256)])
def test_fp8_expert_gemms_are_the_gemms_of_their_dequantized_operands(kernel, k):
    """grouped_linear with an Fp8WeightCache: forward and input gradient against fp32 GEMMs of each expert's
    dequantized blocks (within 5e-3 relative) and the unquantized ones (within 5e-2); experts with no rows, sizes
    not a multiple of 128 (N = 200, K = 160) and K a multiple of it (256: the kernel's loads unmasked along K); the
    weight gradient is the bf16 path's, exactly. kernel: the Triton kernel (the interpreter on CPU), else the
    emulation."""
    torch.manual_seed(6)
    device = KERNEL_DEVICE if kernel else "cpu"
    counts = torch.tensor([70, 0, 3, 130], device=device)
    x = torch.randn(int(counts.sum()), k, device=device).bfloat16().requires_grad_()
    weight = torch.nn.Parameter(torch.randn(4, 200, k, device=device).bfloat16() / 8)
    g = torch.randn(x.shape[0], 200, device=device).bfloat16()
    out = grouped_linear(x, weight, counts, use_triton=kernel, fp8=Fp8WeightCache())
    out.backward(g)
    fp8_grads = (x.grad, weight.grad)
    x.grad = weight.grad = None
    grouped_linear(x, weight, counts, use_triton=kernel).backward(g)
    assert torch.equal(fp8_grads[1], weight.grad)
    w_q = dequantize(*quantize_blocks_reference(weight.detach().float()), BLOCK)
    rows = counts.cpu()
    for got, a, b, exact_b in [(out, x.detach(), w_q, weight.detach()), (fp8_grads[0], g, w_q.transpose(1, 2),
                                                                          weight.detach().transpose(1, 2))]:
        a_q = dequantize(*quantize_rows_reference(a.float()), 1)
        wanted = grouped_linear_reference(a_q.cpu(), b.cpu(), rows)
        exact = grouped_linear_reference(a.float().cpu(), exact_b.float().cpu(), rows)
        assert got.dtype == torch.bfloat16
        assert relative_error(got.float().cpu(), wanted) < 5e-3 and relative_error(got.float().cpu(), exact) < 5e-2
