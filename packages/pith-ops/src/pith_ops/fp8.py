"""FP8 (float8_e4m3fn) quantization in blocks, with power-of-two scales.

Activations and gradients are quantized in 1 x 128 blocks along their last dimension (one scale per row and
128 columns: `quantize_rows`), or along their first dimension with the result transposed (`quantize_columns`:
what a weight gradient's GEMM, which sums over the tokens, reads); weights in 128 x 128 blocks
(`quantize_blocks`), whose transpose is the transposed blocks with the same scales. A block's scale is the power of
two s >= amax / 448 nearest to it, so the block's largest value fits e4m3's largest (448) and dividing by s
only moves the exponent: the quantized value is the e4m3 rounding of x / s and x ~ q * s.

Each function returns (q, scales), scales fp32; the `*_reference` functions are the same in torch, for the
tests and the CPU.

`fp8_linear` runs a linear layer's three GEMMs in FP8: the forward and the input gradient as 1 x 128 by 128 x 128
blocks, the weight gradient as 1 x 128 by 1 x 128 blocks along the tokens (fp32 out), through torch's block-wise
`scaled_mm` on CUDA (measured on the H200: bench/RESULTS.md) and emulated on the CPU (dequantize, then matmul in
fp32). Its weights come from an `Fp8WeightCache`, which quantizes each weight once per optimizer step (or at each
use, where FSDP2 gathers the weight for each use). `traced_fp8_linear` is the same GEMMs as custom ops that
torch.compile traces (pith::fp8_linear and its backward), for compiled stages: the weight quantized at each use, its
gradient returned to autograd. The experts' FP8 GEMMs (`fp8_grouped_rows`, a Triton kernel) run
through `grouped_linear(..., fp8=cache)`.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pith_ops.grouped_gemm import (add_into_grad, expert_strides, grouped_linear_reference, row_tiles,
                                   run_or_queue)

E4M3_MAX = 448.0
BLOCK = 128
FP8_CAPABILITY = (9, 0)   # block-wise scaled_mm runs from Hopper on


def fp8_missing(device: torch.device) -> str | None:
    """None where these FP8 GEMMs run on `device` (a CPU emulates them), else why not, in one line."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= FP8_CAPABILITY:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no block-scaled FP8 "
            f"GEMMs; they need compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (H100, H200)")


@triton.jit
def _power_of_two_at_least(v):
    """The least power of two >= v (v > 0, normal fp32), read off v's exponent bits: exact, where a log2 would
    round."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax):
    return _power_of_two_at_least(tl.maximum(amax / 448.0, 1.1754943508222875e-38))   # fp32's least normal


@triton.jit
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: adding and taking away 1.5 x 2^23
    e4m3 steps of v's binade leaves v on that step's grid. The cast that follows is then exact, where the triton
    interpreter's own cast mis-rounds a carry into the next binade (127.5 -> 64)."""
    binade = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # below 2^-6: subnormal steps
    magic = (((binade + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)   # 1.5 * 2^(binade - 3 + 23)
    return (v + magic) - magic


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, rows, cols, BM: tl.constexpr, BK: tl.constexpr):
    """Rows r0..r0+BM, columns k0..k0+BK: one scale per row."""
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    inside = (r[:, None] < rows) & (k[None, :] < cols)
    offsets = r[:, None].to(tl.int64) * cols + k[None, :]
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(x), axis=1))
    tl.store(q_ptr + offsets, _round_to_e4m3(x / scale[:, None]).to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(s_ptr + r * tl.num_programs(1) + tl.program_id(1), scale, mask=r < rows)


@triton.jit
def _quantize_columns_kernel(x_ptr, q_ptr, s_ptr, rows, cols, BK: tl.constexpr, BN: tl.constexpr):
    """Rows k0..k0+BK (the summed dimension), columns n0..n0+BN of x [rows, cols]: one scale per column, written
    transposed: q [cols, rows], s [cols, row blocks]."""
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    inside = (k[:, None] < rows) & (n[None, :] < cols)
    x = tl.load(x_ptr + k[:, None].to(tl.int64) * cols + n[None, :], mask=inside, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(x), axis=0))
    q = _round_to_e4m3(x / scale[None, :]).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + n[None, :].to(tl.int64) * rows + k[:, None], q, mask=inside)
    tl.store(s_ptr + n * tl.num_programs(0) + tl.program_id(0), scale, mask=n < cols)


@triton.jit
def _quantize_blocks_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols, BN: tl.constexpr, BK: tl.constexpr,
                            BOTH: tl.constexpr):
    """One BN x BK block of matrix program_id(2) (an expert's), one scale; BOTH: also written transposed, into
    qt [cols, rows] and st [col blocks, row blocks] of that matrix."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    inside = (n[:, None] < rows) & (k[None, :] < cols)
    matrix = tl.program_id(2).to(tl.int64) * rows * cols
    x = tl.load(x_ptr + matrix + n[:, None].to(tl.int64) * cols + k[None, :], mask=inside, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    rounded = _round_to_e4m3(x / scale)
    tl.store(q_ptr + matrix + n[:, None].to(tl.int64) * cols + k[None, :], rounded.to(q_ptr.dtype.element_ty),
             mask=inside)
    blocks = tl.num_programs(0) * tl.num_programs(1)
    tl.store(s_ptr + tl.program_id(2) * blocks + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), scale)
    if BOTH:
        # transposed in bf16 (exact for e4m3 values): an e4m3 tile transposed from fp32 loads came out scrambled on
        # the H200 (triton 3.6)
        q_t = tl.trans(rounded.to(tl.bfloat16)).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + matrix + k[:, None].to(tl.int64) * rows + n[None, :], q_t, mask=tl.trans(inside))
        tl.store(st_ptr + tl.program_id(2) * blocks + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), scale)


@triton.jit
def _fp8_rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, offs_ptr, tile_expert_ptr, tile_first_ptr, n_cols, k_dim,
                     stride_be, stride_bk, stride_bn, scale_e, scale_k, scale_n, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, EVEN_K: tl.constexpr):
    """out[rows of e] = a[rows of e] @ B_e in FP8: a in 1 x BK blocks (scales sa [rows, k blocks]), B_e in BK x BN
    blocks (scale of k block i, n block j at sb + e * scale_e + i * scale_k + j * scale_n); each block's product
    summed in fp32 by the tensor cores, then scaled and added (BN = BK = the blocks' 128). Program p computes row
    tile p // column tiles, column tile p % column tiles: the programs running together share a few row tiles
    (read from L2, not again from memory for each column tile) and their expert's weight."""
    col_tiles = tl.cdiv(n_cols, BN)
    tile, col_tile = tl.program_id(0) // col_tiles, tl.program_id(0) % col_tiles
    expert = tl.load(tile_expert_ptr + tile)
    row_end = tl.load(offs_ptr + expert)
    row_start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    first_row = row_start + (tile - tl.load(tile_first_ptr + expert)) * BM
    if first_row >= row_end:
        return
    rows, cols = first_row + tl.arange(0, BM), col_tile * BN + tl.arange(0, BN)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * k_dim + tl.arange(0, BK)[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + tl.arange(0, BK)[:, None] * stride_bk + cols[None, :] * stride_bn
    k_blocks = tl.cdiv(k_dim, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, k_blocks):
        ks = kb * BK + tl.arange(0, BK)
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows[:, None] < row_end, other=0.0)
            b = tl.load(b_ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=(rows[:, None] < row_end) & (ks[None, :] < k_dim), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] < k_dim) & (cols[None, :] < n_cols), other=0.0)
        row_scales = tl.load(sa_ptr + rows.to(tl.int64) * k_blocks + kb, mask=rows < row_end, other=0.0)
        block_scale = tl.load(sb_ptr + expert * scale_e + kb * scale_k + col_tile * scale_n)
        acc += tl.dot(a, b) * (row_scales[:, None] * block_scale)
        a_ptrs += BK
        b_ptrs += BK * stride_bk
    tl.store(out_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < row_end) & (cols[None, :] < n_cols))


def _empty(x, *shape, dtype):
    return torch.empty(*shape, dtype=dtype, device=x.device)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> q [M, K] e4m3, scales [M, ceil(K / 128)]: 1 x 128 blocks along K."""
    x = x.contiguous()
    (rows, cols), blocks = x.shape, triton.cdiv(x.shape[1], BLOCK)
    q, scales = _empty(x, rows, cols, dtype=torch.float8_e4m3fn), _empty(x, rows, blocks, dtype=torch.float32)
    _quantize_rows_kernel[(triton.cdiv(rows, 32), blocks)](x, q, scales, rows, cols, BM=32, BK=BLOCK)
    return q, scales


def quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] -> q [N, M] e4m3 (x transposed), scales [N, ceil(M / 128)]: 1 x 128 blocks along M, the
    quantize_rows of x.T in one pass."""
    x = x.contiguous()
    (rows, cols), blocks = x.shape, triton.cdiv(x.shape[0], BLOCK)
    q, scales = _empty(x, cols, rows, dtype=torch.float8_e4m3fn), _empty(x, cols, blocks, dtype=torch.float32)
    _quantize_columns_kernel[(blocks, triton.cdiv(cols, 32))](x, q, scales, rows, cols, BK=BLOCK, BN=32)
    return q, scales


def quantize_blocks(w: torch.Tensor, both: bool = False) -> tuple:
    """w [N, K] -> q [N, K] e4m3, scales [ceil(N / 128), ceil(K / 128)]: 128 x 128 blocks; w [E, N, K] (a stack
    of experts' weights) -> each expert's blocks, scales [E, ceil(N / 128), ceil(K / 128)]. both: -> (those, the
    same of w.T: `transposed` of them), written in the same pass."""
    w = w.contiguous()
    (rows, cols), grid = w.shape[-2:], (triton.cdiv(w.shape[-2], BLOCK), triton.cdiv(w.shape[-1], BLOCK))
    q, scales = torch.empty_like(w, dtype=torch.float8_e4m3fn), _empty(w, *w.shape[:-2], *grid, dtype=torch.float32)
    q_t, scales_t = (_empty(w, *w.shape[:-2], cols, rows, dtype=torch.float8_e4m3fn),
                     _empty(w, *w.shape[:-2], *grid[::-1], dtype=torch.float32)) if both else (q, scales)
    _quantize_blocks_kernel[(*grid, w[..., 0, 0].numel())](w, q, scales, q_t, scales_t, rows, cols, BN=BLOCK, BK=BLOCK,
                                                             BOTH=both)
    return ((q, scales), (q_t, scales_t)) if both else (q, scales)


def power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """The least power of two >= amax / 448 (at least fp32's least normal), exactly: frexp's exponent."""
    v = torch.clamp(amax.float() / E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    mantissa, exponent = torch.frexp(v)   # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), exponent - (mantissa == 0.5).to(exponent.dtype))


def _blocked(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [M, K] zero-padded to whole blocks, as [M / rows, rows, K / cols, cols]."""
    padded = torch.nn.functional.pad(x.float(), (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))
    return padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def _quantize_reference(x, rows, cols):
    blocks = _blocked(x, rows, cols)
    scales = power_of_two_scales(blocks.abs().amax(dim=(1, 3), keepdim=True))
    q = (blocks / scales).to(torch.float8_e4m3fn).flatten(0, 1).flatten(1)[:x.shape[0], :x.shape[1]]
    return q, scales[:, 0, :, 0]


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_reference(x, 1, BLOCK)


def quantize_blocks_reference(w: torch.Tensor, both: bool = False) -> tuple:
    if w.dim() == 3:
        blocks = tuple(torch.stack(parts) for parts in zip(*(_quantize_reference(e, BLOCK, BLOCK) for e in w)))
    else:
        blocks = _quantize_reference(w, BLOCK, BLOCK)
    return (blocks, transposed(blocks)) if both else blocks


def dequantize(q: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """q * its blocks' scales, fp32: rows 1 for 1 x 128 blocks, 128 for 128 x 128 (of each matrix of a stack)."""
    full = scales.repeat_interleave(rows, -2).repeat_interleave(BLOCK, -1)
    return q.float() * full[..., :q.shape[-2], :q.shape[-1]]


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.T.contiguous().T


def _weight_scales(scales: torch.Tensor) -> torch.Tensor:
    """[N blocks, K blocks] as scaled_mm reads a 128 x 128-block operand's: [K blocks, N blocks] column-major, the K
    blocks padded to a multiple of 4 (torch 2.11 on the H200 refused K = 1408, 2880 and 768 unpadded)."""
    padded = F.pad(scales.T, (0, 0, 0, -scales.shape[1] % 4), value=1.0)
    return _column_major(padded)


def matmul_rows_blocks(a: tuple, b: tuple, out_dtype=torch.bfloat16) -> torch.Tensor:
    """a @ b.T for a = quantize_rows(x) [M, K] and b = quantize_blocks(w) [N, K] (or a weight block-transposed:
    `transposed`); -> [M, N] in out_dtype."""
    if not a[0].is_cuda:
        return (dequantize(*a, 1) @ dequantize(*b, BLOCK).T).to(out_dtype)
    return F.scaled_mm(a[0], b[0].T, _column_major(a[1]), F.ScalingType.BlockWise1x128, _weight_scales(b[1]),
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def matmul_rows_rows(a: tuple, b: tuple, out_dtype=torch.float32) -> torch.Tensor:
    """a @ b.T for a [N, M] and b [K, M] both in 1 x 128 blocks along M (quantize_columns of g [M, N] and of
    x [M, K]: the weight gradient g.T @ x); -> [N, K] in out_dtype."""
    if not a[0].is_cuda:
        return (dequantize(*a, 1) @ dequantize(*b, 1).T).to(out_dtype)
    return F.scaled_mm(a[0], b[0].T, _column_major(a[1]), F.ScalingType.BlockWise1x128, _column_major(b[1]),
                       F.ScalingType.BlockWise1x128, output_dtype=out_dtype)


def transposed(blocks: tuple) -> tuple:
    """quantize_blocks(w) -> that of w.T (of each matrix of a stack): the blocks transposed, each with its scale."""
    return tuple(t.transpose(-2, -1).contiguous() for t in blocks)


class Fp8WeightCache:
    """Each weight's FP8 blocks and their transpose (what the input gradient reads), made at
    the weight's first use after an optimizer step and served to every micro-batch of the step and its backward.
    `new_step` (which the hook of `watch` runs before each optimizer step) drops them all: they are freed before
    the optimizer runs and never served after it. An in-place change between steps (a load) is seen through the
    weight's version counter. A compute copy (a bf16 copy naming its fp32 master as `grad_into`, made anew for each
    forward) is known by its master, whose version and storage say whether the copy's values changed.

    keep=False, for weights that FSDP2 gathers anew for each forward and backward and frees after: each use
    quantizes the layout it reads and holds nothing. Kept, every layer's blocks stayed through the step (2 bytes per
    element of each FP8 weight on the rank, as much as its fp32 weights, gradients and AdamW state at 8 shards),
    while most gathers, into new storage, were quantized again anyway (175-185 of a step's 192 uses on 2 CPU ranks)."""

    def __init__(self, keep: bool = True):
        self.keep, self.copies, self.quantized = keep, {}, 0   # quantized: weights quantized, for tests and logs

    def watch(self, optimizer: torch.optim.Optimizer):
        optimizer.register_step_pre_hook(lambda *args: self.new_step())
        return self

    def new_step(self):
        self.copies.clear()

    def blocks(self, weight: torch.Tensor, transpose: bool = False) -> tuple:
        """quantize_blocks(weight), or its transposed. Both are made at once, on CUDA by one pass over the weight:
        a training step's backward reads the transposed (a copy of the e4m3 blocks by torch took the H200 13.5 ms
        per Qwen3-30B-A3B 4-layer step)."""
        if not self.keep:
            self.quantized += 1
            return _weight_blocks(weight, both=True)[1] if transpose else _weight_blocks(weight)
        source = getattr(weight, "grad_into", weight)
        state = (source._version, source.data_ptr())
        known = self.copies.get(id(source))
        if known is None or known[0] != state:
            known = self.copies[id(source)] = (state, _weight_blocks(weight, both=True))
            self.quantized += 1
        return known[1][transpose]

    def grouped_rows(self, a, weight, offs, kernel: bool, transpose: bool = False) -> torch.Tensor:
        """fp8_grouped_rows of a against this step's blocks of the expert stack `weight` (transpose: its transposed
        blocks, for the input gradient): what grouped_linear(fp8=self) runs."""
        return fp8_grouped_rows(a, self.blocks(weight, transpose), offs, kernel)


@torch.no_grad()
def _weight_blocks(weight: torch.Tensor, both: bool = False) -> tuple:
    """quantize_blocks(weight, both) by the kernel on CUDA, by the reference elsewhere: made now, held by no one."""
    return (quantize_blocks if weight.is_cuda else quantize_blocks_reference)(weight, both=both)


def _rows(x, kernel=None):
    """quantize_rows by the Triton kernel (default: on CUDA), or by the torch reference."""
    return quantize_rows(x) if (x.is_cuda if kernel is None else kernel) else quantize_rows_reference(x)


def _columns(x):
    """The weight gradient's operand: 1 x 128 blocks along the tokens, which scaled_mm sums over in whole blocks
    (it refused 4 tokens), so a partial block is padded with zero rows, which add nothing."""
    if x.shape[0] % BLOCK:
        x = F.pad(x, (0, 0, 0, -x.shape[0] % BLOCK))
    return quantize_columns(x) if x.is_cuda else quantize_rows_reference(x.T)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cache, wgrad_queue):
        rows = x.reshape(-1, x.shape[-1])
        ctx.cache, ctx.wgrad_queue, ctx.shape = cache, wgrad_queue, x.shape
        ctx.weight, ctx.master = weight, getattr(weight, "grad_into", weight)
        ctx.x_columns = _columns(rows)   # the input as the weight gradient reads it, kept in FP8
        out = matmul_rows_blocks(_rows(rows), cache.blocks(weight), x.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = matmul_rows_blocks(_rows(grad), ctx.cache.blocks(ctx.weight, True), grad_out.dtype).view(ctx.shape)
        grad_columns, x_columns, master = _columns(grad), ctx.x_columns, ctx.master

        run_or_queue(lambda: add_into_grad(master, matmul_rows_rows(grad_columns, x_columns)), ctx.wgrad_queue)
        return grad_x, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache, wgrad_queue=None) -> torch.Tensor:
    """x @ weight.T with FP8 GEMMs (no bias), forward and backward. The weight's gradient (fp32 products) is
    added into weight.grad by the backward itself (grad_into's for a compute copy that names its fp32 master),
    or queued on wgrad_queue to run later; autograd sees none."""
    return _Fp8Linear.apply(x, weight, cache, wgrad_queue)


# The same three GEMMs as custom ops with fake implementations, for compiled graphs (Linear under torch.compile):
# dynamo cannot trace _Fp8Linear, whose weight blocks come from a Python cache and whose weight gradient is added
# into the master as a side effect. The forward quantizes the weight at each use, both layouts in one pass, and keeps
# the transposed blocks for the backward (so a graph holds no blocks between calls); the weight gradient goes back to
# autograd in the weight's dtype.
def _linear_forward(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor]:
    """-> (x @ weight.T in x's dtype, the FP8 blocks of x that the weight gradient reads (_columns(x)), then the
    weight's transposed blocks and scales, which the input gradient reads)."""
    rows = x.reshape(-1, x.shape[-1])
    blocks, blocks_t = _weight_blocks(weight, both=True)
    out = matmul_rows_blocks(_rows(rows), blocks, x.dtype)
    columns = (t.contiguous() for t in _columns(rows))   # the CPU reference's come out transposed
    return (out.view(*x.shape[:-1], weight.shape[0]), *columns, *(t.contiguous() for t in blocks_t))


fp8_linear_forward = torch.library.custom_op("pith::fp8_linear", _linear_forward, mutates_args=())


@fp8_linear_forward.register_fake
def _(x, weight):
    tokens = math.prod(x.shape[:-1])
    padded = tokens + -tokens % BLOCK   # _columns pads the tokens to whole blocks
    (n, k), e4m3 = weight.shape, torch.float8_e4m3fn
    return (x.new_empty(*x.shape[:-1], n), x.new_empty(k, padded, dtype=e4m3),
            x.new_empty(k, padded // BLOCK, dtype=torch.float32), x.new_empty(k, n, dtype=e4m3),
            x.new_empty(-(-k // BLOCK), -(-n // BLOCK), dtype=torch.float32))


def _linear_backward(grad_out: torch.Tensor, x_q: torch.Tensor, x_scales: torch.Tensor, w_t: torch.Tensor,
                     w_t_scales: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the input gradient in grad_out's dtype, the weight gradient in the weight's: fp32 products)."""
    grad = grad_out.reshape(-1, grad_out.shape[-1])
    grad_x = matmul_rows_blocks(_rows(grad), (w_t, w_t_scales), grad_out.dtype)
    grad_w = matmul_rows_rows(_columns(grad), (x_q, x_scales), weight.dtype)
    return grad_x.view(*grad_out.shape[:-1], weight.shape[1]), grad_w


fp8_linear_backward = torch.library.custom_op("pith::fp8_linear_backward", _linear_backward, mutates_args=())


@fp8_linear_backward.register_fake
def _(grad_out, x_q, x_scales, w_t, w_t_scales, weight):
    return grad_out.new_empty(*grad_out.shape[:-1], weight.shape[1]), torch.empty_like(weight)


def _save_for_linear_backward(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:], inputs[1])


def _linear_backward_of(ctx, grad_out, *unused):   # unused: the blocks' gradients, which are none
    return fp8_linear_backward(grad_out, *ctx.saved_tensors)


fp8_linear_forward.register_autograd(_linear_backward_of, setup_context=_save_for_linear_backward)


def traced_fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp8_linear's GEMMs as one op torch.compile traces (pith::fp8_linear): x @ weight.T (no bias), the weight
    quantized at each forward (both layouts, the transposed kept for the backward) and its gradient returned to
    autograd in its dtype, as nn.Linear's is."""
    return fp8_linear_forward(x, weight)[0]


# 64-row tiles, 4 warps, 3 stages: of 13 tile / warp / stage / scale-layout choices on the H200 the fastest or within
# 2% at the six expert shapes (bench/RESULTS.md)
FP8_LAUNCH = dict(BM=64, num_warps=4, num_stages=3)


def fp8_grouped_rows(a: torch.Tensor, weight_blocks: tuple, offs, kernel: bool, **launch) -> torch.Tensor:
    """In FP8, per expert: a_rows @ w[e].T, bf16 out, for a [rows, K] bf16 (quantized here in 1 x 128 blocks) and
    weight_blocks = quantize_blocks(w [E, N, K]) (the input gradient passes the transposed blocks of its weight,
    so that the kernel reads each weight along K, as the FP8 tensor cores want: read across, it ran at 85 TFLOP/s
    on the H200). kernel: the Triton kernel; else emulated (each operand dequantized, fp32 GEMMs)."""
    (a_q, a_scales), (w_q, w_scales) = _rows(a, kernel), weight_blocks
    if not kernel:
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        out = grouped_linear_reference(dequantize(a_q, a_scales, 1), dequantize(w_q, w_scales, BLOCK), counts)
        return torch.cat([out, out.new_zeros(a.shape[0] - out.shape[0], out.shape[1])]).to(a.dtype)   # absent rows
    launch = FP8_LAUNCH | launch
    tile_expert, tile_first, max_tiles = row_tiles(offs, a.shape[0], launch["BM"])
    out = a.new_empty(a.shape[0], w_q.shape[1])
    _fp8_rows_kernel[(max_tiles * triton.cdiv(w_q.shape[1], BLOCK),)](
        a_q, a_scales, w_q, w_scales, out, offs, tile_expert, tile_first, w_q.shape[1], a.shape[1],
        *expert_strides(w_q, True), *expert_strides(w_scales, True), BN=BLOCK, BK=BLOCK,
        EVEN_K=a.shape[1] % BLOCK == 0, **launch)
    return out

