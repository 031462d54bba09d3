"""Expert GEMMs over tokens sorted by expert: one matmul per expert, launched as one grouped GEMM.

Rows offs[e-1]:offs[e] of the input belong to expert e (offs = running sum of tokens_per_expert), so
experts without tokens cost nothing and nothing waits for the host. Rows past offs[-1] (absent slots, which a
fixed-size buffer holds after the experts' rows) are neither read nor written: their outputs are undefined. Torch's grouped_mm runs where it
has a kernel (CPU, and CUDA from Hopper on); elsewhere the Triton kernels below run.

The backward computes the input gradient (dgrad) and the weight gradient (wgrad) separately. Given a
`wgrad_queue` list, the backward appends a closure that computes and accumulates the weight gradient
instead of computing it, so a pipeline schedule can run it later (zero-bubble W steps); `deferred_linear` does
the same for a dense linear.
"""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def grouped_linear_reference(x, weight, tokens_per_expert):
    """Rows past the experts' ranges (absent slots) left out."""
    rows = torch.split(x[:int(tokens_per_expert.sum())], tokens_per_expert.tolist())
    return torch.cat([r @ w.T for r, w in zip(rows, weight)]) if rows else x.new_empty(0, weight.shape[1])


@triton.jit
def _grouped_rows_kernel(a_ptr, b_ptr, out_ptr, offs_ptr, tile_expert_ptr, tile_first_ptr, n_cols, k_dim,
                         stride_be, stride_bk, stride_bn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """out[rows of e] = a[rows of e] @ B_e, where B_e[k, n] = b[e * stride_be + k * stride_bk + n * stride_bn]."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    row_end = tl.load(offs_ptr + expert)
    row_start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    rows = row_start + (tile - tl.load(tile_first_ptr + expert)) * BM + tl.arange(0, BM)
    if row_start + (tile - tl.load(tile_first_ptr + expert)) * BM >= row_end:
        return  # a spare tile of the launch grid, sized without asking the host for the counts
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_dim, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * k_dim + ks[None, :],
                    mask=(rows[:, None] < row_end) & (ks[None, :] < k_dim), other=0.0)
        b = tl.load(b_ptr + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(ks[:, None] < k_dim) & (cols[None, :] < n_cols), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < row_end) & (cols[None, :] < n_cols))


@triton.jit
def _add_expert_rows(acc, g_ptr, x_ptr, offs_ptr, expert, outs, ins, n_out, n_in, BK: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + g[rows of expert, outs].T @ x[rows of expert, ins]."""
    row_end = tl.load(offs_ptr + expert)
    row_start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    for r0 in range(row_start, row_end, BK):
        rows = r0 + tl.arange(0, BK)
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * n_out + outs[None, :],
                    mask=(rows[:, None] < row_end) & (outs[None, :] < n_out), other=0.0)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * n_in + ins[None, :],
                    mask=(rows[:, None] < row_end) & (ins[None, :] < n_in), other=0.0)
        if UPCAST:
            g, x = g.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grouped_wgrad_kernel(g_ptr, x_ptr, offs_ptr, g2_ptr, x2_ptr, offs2_ptr, out_ptr, n_out, n_in,
                          ACCUMULATE: tl.constexpr, PAIRED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """out[e] (+)= g[rows of e].T @ x[rows of e]: [n_out, n_in] per expert; PAIRED: plus the same over g2, x2,
    offs2 (a second micro-batch), in the same fp32 sum. Without ACCUMULATE an expert without rows gets zeros;
    with it, its tiles are neither read nor written. The fp32 sum of the tile is added to out in out's dtype
    (fp32 for master gradients), so no bf16 gradient is ever written."""
    tiles_out, tiles_in = tl.cdiv(n_out, BM), tl.cdiv(n_in, BN)
    tile = tl.program_id(0)
    expert = tile // (tiles_out * tiles_in)   # the slowest index: one expert's tiles share its rows in L2
    rows = tl.load(offs_ptr + expert) - tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    if PAIRED:
        rows += tl.load(offs2_ptr + expert) - tl.load(offs2_ptr + expert - 1, mask=expert > 0, other=0)
    if ACCUMULATE and rows == 0:
        return
    outs = (tile // tiles_in) % tiles_out * BM + tl.arange(0, BM)
    ins = tile % tiles_in * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _add_expert_rows(acc, g_ptr, x_ptr, offs_ptr, expert, outs, ins, n_out, n_in, BK, UPCAST, PRECISION)
    if PAIRED:
        acc = _add_expert_rows(acc, g2_ptr, x2_ptr, offs2_ptr, expert, outs, ins, n_out, n_in, BK, UPCAST,
                               PRECISION)
    out = out_ptr + expert.to(tl.int64) * n_out * n_in + outs[:, None] * n_in + ins[None, :]
    inside = (outs[:, None] < n_out) & (ins[None, :] < n_in)
    if ACCUMULATE:
        acc += tl.load(out, mask=inside, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)


BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
# Triton's CPU interpreter computes bf16 dots wrongly; fp32 operands give what the GPU's bf16 MMA gives
# (exact products, fp32 accumulation), so under the interpreter the kernels upcast first.
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


def _precision(t: torch.Tensor) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), not the GPU's default tf32; bf16 is unaffected."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


def row_tiles(offs, rows: int, block: int):
    """(tile_expert, tile_first, tiles): the expert of each tile of `block` rows, each expert's first tile, and
    the launch's tile count, sized without asking the host for the counts (each expert wastes at most one tile)."""
    num_experts = offs.shape[0]
    tiles = torch.diff(offs, prepend=offs.new_zeros(1)).add(block - 1).div(block, rounding_mode="floor")
    tile_first = torch.cumsum(tiles, 0) - tiles
    max_tiles = triton.cdiv(rows, block) + num_experts
    tile_expert = torch.searchsorted(tile_first + tiles, torch.arange(max_tiles, device=offs.device), right=True)
    return tile_expert.clamp_(max=num_experts - 1), tile_first, max_tiles


def expert_strides(t, transpose: bool) -> tuple:
    """(expert, k, n) strides of a weight stack [E, n, k] read as B_e[k, n] (transpose), or [E, k, n] as it is."""
    return (t.stride(0), t.stride(2), t.stride(1)) if transpose else (t.stride(0), t.stride(1), t.stride(2))


def _triton_rows(a, b, offs, n_cols, transpose_b: bool):
    """Per expert: a_rows @ b[e].T (forward, b [E, n_cols, k]) or a_rows @ b[e] (dgrad, b [E, k, n_cols])."""
    tile_expert, tile_first, max_tiles = row_tiles(offs, a.shape[0], BLOCK_M)
    out = a.new_empty(a.shape[0], n_cols)
    grid = (max_tiles, triton.cdiv(n_cols, BLOCK_N))
    _grouped_rows_kernel[grid](a, b, out, offs, tile_expert, tile_first, n_cols, a.shape[1], *expert_strides(b, transpose_b),
                               BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, UPCAST=UPCAST, PRECISION=_precision(a))
    return out


def _triton_wgrad(grad_out, x, offs, out, accumulate, blocks=(BLOCK_M, BLOCK_N, BLOCK_K), paired=None, **launch):
    """paired: (grad_out, x, offs) of a second micro-batch, summed into the same pass."""
    tiles = triton.cdiv(grad_out.shape[1], blocks[0]) * triton.cdiv(x.shape[1], blocks[1])
    _grouped_wgrad_kernel[(out.shape[0] * tiles,)](grad_out, x, offs, *(paired or (grad_out, x, offs)), out,
                                                   grad_out.shape[1], x.shape[1], accumulate, paired is not None,
                                                   *blocks, UPCAST=UPCAST, PRECISION=_precision(x), **launch)
    return out


def _use_torch(t: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is not None:
        return not use_triton
    return not t.is_cuda or torch.cuda.get_device_capability(t.device) >= (9, 0)


def grouped_forward(x, weight, offs, use_triton=None):
    if _use_torch(x, use_triton):
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    return _triton_rows(x.contiguous(), weight, offs, weight.shape[1], transpose_b=True)


def grouped_dgrad(grad_out, weight, offs, use_triton=None):
    if _use_torch(grad_out, use_triton):
        return F.grouped_mm(grad_out, weight, offs=offs)
    return _triton_rows(grad_out.contiguous(), weight, offs, weight.shape[2], transpose_b=False)


def grouped_wgrad(grad_out, x, offs, use_triton=None):
    if _use_torch(x, use_triton):
        return F.grouped_mm(grad_out.T, x, offs=offs)
    out = grad_out.new_empty(offs.shape[0], grad_out.shape[1], x.shape[1])
    return _triton_wgrad(grad_out.contiguous(), x.contiguous(), offs, out, False)


def add_wgrad_into(param, grad_out, x, offs, paired=None):
    """param.grad (+)= the weight gradient, summed in fp32 by the Triton kernel and added in param.grad's dtype:
    an fp32 master gradient gets no bf16 rounding per micro-batch, and no bf16 gradient is written and
    re-read. paired: (grad_out, x, offs) of another micro-batch, added in the same pass (WgradPairs).
    128 x 128 x 64 tiles, 4 warps, 3 stages: of 8 tile shapes on the H200, the fastest at 5 of the 6
    expert shapes measured and within 1% at the sixth (bench/RESULTS.md)."""
    first = param.grad is None
    if first:
        param.grad = torch.empty_like(param)
    _triton_wgrad(grad_out, x.contiguous(), offs, param.grad, not first, blocks=(128, 128, 64),
                  paired=paired and (paired[0], paired[1].contiguous(), paired[2]), num_warps=4, num_stages=3)


class WgradPairs:
    """Expert weight gradients two micro-batches at a time. The kernel that adds a micro-batch's gradient into
    .grad is bound by reading and writing the whole gradient (bench/RESULTS.md); so the backward of one
    micro-batch hands its inputs here (`add`) and the next micro-batch's backward adds both in one pass,
    which halves that traffic. The cost: one micro-batch's expert inputs and output gradients stay alive
    until its pair comes. A step calls `flush` before it reads any gradient (an odd micro-batch waits)."""

    def __init__(self):
        self.waiting = {}

    def add(self, into, grad_out, x, offs):
        held = self.waiting.pop(id(into), None)
        if held is None:
            self.waiting[id(into)] = (into, grad_out, x, offs)
        else:
            add_wgrad_into(into, grad_out, x, offs, paired=held[1:])

    def flush(self):
        for into, *inputs in self.waiting.values():
            add_wgrad_into(into, *inputs)
        self.waiting.clear()


def add_into_grad(master, grad):
    """master.grad += grad; master: the parameter, or the fp32 one a compute copy names (`grad_into`)."""
    master.grad = grad.to(master.dtype) if master.grad is None else master.grad.add_(grad)


def add_product_into_grad(master, a, b):
    """master.grad += a @ b (add_into_grad of the product). On CUDA the GEMM reads and writes .grad itself, an fp32
    one for bf16 operands through out_dtype, where the product would be written in a's dtype and then added."""
    if not a.is_cuda:
        return add_into_grad(master, a @ b)
    mixed = dict(out_dtype=master.dtype) if master.dtype != a.dtype else {}
    if master.grad is None:
        master.grad = torch.mm(a, b, **mixed)
    else:
        torch.addmm(master.grad, a, b, out=master.grad, **mixed)


def run_or_queue(accumulate_wgrad, wgrad_queue):
    """A backward's weight-gradient closure: run now, or appended to wgrad_queue to run later (a W step)."""
    if wgrad_queue is None:
        accumulate_wgrad()
    else:
        wgrad_queue.append(accumulate_wgrad)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, wgrad_queue):
        ctx.save_for_backward(x, weight)
        ctx.wgrad_queue = wgrad_queue
        ctx.masters = [getattr(p, "grad_into", p) for p in (weight, bias)]   # the fp32 masters of compute copies
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        (weight_into, bias_into), grad_out = ctx.masters, grad_out.reshape(-1, grad_out.shape[-1])
        weight_wanted, bias_wanted = ctx.needs_input_grad[1:3]

        def accumulate_wgrad():
            if weight_wanted:
                add_product_into_grad(weight_into, grad_out.T, x.reshape(-1, x.shape[-1]))
            if bias_wanted:
                add_into_grad(bias_into, grad_out.sum(0))
        ctx.wgrad_queue.append(accumulate_wgrad)
        grad_x = (grad_out @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wgrad_queue) -> torch.Tensor:
    """F.linear whose backward computes only the input gradient and appends to `wgrad_queue` a closure that adds
    the weight's (and the bias's) gradient into .grad (grad_into's for a compute copy), as grouped_linear's does."""
    return _DeferredLinear.apply(x, weight, bias, wgrad_queue)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offs, wgrad_queue, wgrad_pairs, use_triton, fp8):
        ctx.save_for_backward(x, weight, offs)
        ctx.wgrad_queue, ctx.wgrad_pairs, ctx.use_triton, ctx.fp8 = wgrad_queue, wgrad_pairs, use_triton, fp8
        ctx.grad_into = getattr(weight, "grad_into", None)
        # the parameter whose .grad takes the gradient, kept as itself: a saved tensor comes back as a detached alias
        # when activation recompute (torch.utils.checkpoint) made it, and a .grad set on that would be lost
        ctx.master = ctx.grad_into if ctx.grad_into is not None else weight
        ctx.weight = weight if fp8 is not None else None   # (as itself too: the FP8 cache knows a weight by its master)
        if fp8 is not None:
            return fp8.grouped_rows(x, weight, offs, x.is_cuda if use_triton is None else use_triton)
        return grouped_forward(x, weight, offs, use_triton)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        triton_here = x.is_cuda if ctx.use_triton is None else ctx.use_triton
        grad_x = None
        if ctx.needs_input_grad[0] and ctx.fp8 is not None:
            grad_x = ctx.fp8.grouped_rows(grad_out, ctx.weight, offs, triton_here, transpose=True)
        elif ctx.needs_input_grad[0]:
            grad_x = grouped_dgrad(grad_out, weight, offs, ctx.use_triton)
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None, None, None, None, None
        into = ctx.grad_into if triton_here else None
        if ctx.wgrad_queue is None and into is None:
            return grad_x, grouped_wgrad(grad_out, x, offs, ctx.use_triton), None, None, None, None, None
        use_triton, pairs, master = ctx.use_triton, ctx.wgrad_pairs, ctx.master

        def accumulate_wgrad():
            if into is not None:
                (add_wgrad_into if pairs is None else pairs.add)(into, grad_out, x, offs)
            else:
                add_into_grad(master, grouped_wgrad(grad_out, x, offs, use_triton))
        run_or_queue(accumulate_wgrad, ctx.wgrad_queue)
        return grad_x, None, None, None, None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                   wgrad_queue: list | None = None, wgrad_pairs: WgradPairs | None = None,
                   use_triton: bool | None = None, fp8=None) -> torch.Tensor:
    """x [tokens, in] sorted by expert, weight [experts, out, in] (nn.Linear layout) -> [tokens, out].

    wgrad_queue: if given, the weight gradient is not returned by backward but appended to it as a closure
    that adds it to weight.grad (to grad_into.grad for a compute copy). use_triton: force the Triton kernels (True) or torch's grouped_mm (False).
    A weight that carries `grad_into` (a compute copy of a master parameter, as ComputeCasts makes) gets
    no gradient through autograd: where the Triton kernels run (CUDA unless use_triton=False, or
    use_triton=True) the weight-gradient kernel adds it straight into grad_into.grad (add_wgrad_into);
    elsewhere it is returned as usual; given `wgrad_pairs`, that kernel runs once per two micro-batches.
    fp8: a pith_ops.fp8.Fp8WeightCache: the forward and the input gradient in FP8 (its grouped_rows), the weight
    quantized as the cache says (once per optimizer step, or at each use); the weight gradient stays in bf16 (an
    FP8 one would need blocks along each expert's tokens, and its GEMM gained least from FP8: bench/RESULTS.md).
    """
    offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    return _GroupedLinear.apply(x, weight, offs, wgrad_queue, wgrad_pairs, use_triton, fp8)


@triton.jit
def _segment_sum_kernel(grad_ptr, offs_ptr, out_ptr, n_cols, BM: tl.constexpr, BN: tl.constexpr):
    """out[e] = sum of grad rows offs[e-1]:offs[e], one program per (expert, column block): no atomics."""
    expert = tl.program_id(0)
    row_end = tl.load(offs_ptr + expert)
    row_start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)   # reduced over rows once, after the loop
    for r0 in range(row_start, row_end, BM):
        rows = r0 + tl.arange(0, BM)
        acc += tl.load(grad_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :],
                       mask=(rows[:, None] < row_end) & (cols[None, :] < n_cols), other=0.0).to(tl.float32)
    tl.store(out_ptr + expert * n_cols + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def segment_sum(grad: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """[experts, cols]: the sum of each expert's contiguous rows of grad (fp32 accumulation)."""
    offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    out = grad.new_empty(tokens_per_expert.shape[0], grad.shape[1])
    # 16 x 256 tiles, 4 warps: the fastest of a sweep of tile shapes and row splits on the H200 (bench/RESULTS.md)
    _segment_sum_kernel[(out.shape[0], triton.cdiv(grad.shape[1], 256))](grad, offs, out, grad.shape[1],
                                                                         BM=16, BN=256, num_warps=4)
    return out


class _GroupedBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tokens_per_expert, use_kernel):
        ctx.save_for_backward(tokens_per_expert)
        ctx.use_kernel = use_kernel
        # rows past the experts' ranges (absent slots: undefined, never read) take the last expert's bias
        ends = torch.cumsum(tokens_per_expert, 0)
        expert_of_row = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device), right=True)
        return x + bias.index_select(0, expert_of_row.clamp_(max=bias.shape[0] - 1))

    @staticmethod
    def backward(ctx, grad):
        (tokens_per_expert,) = ctx.saved_tensors
        grad = grad.contiguous()
        if not ctx.use_kernel:
            segments = torch.split(grad[:int(tokens_per_expert.sum())].float(), tokens_per_expert.tolist())
            return grad, torch.stack([s.sum(0) for s in segments]).to(grad.dtype), None, None
        return grad, segment_sum(grad, tokens_per_expert), None, None


def grouped_bias_add(x: torch.Tensor, bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                     use_kernel: bool | None = None) -> torch.Tensor:
    """x [rows, out] sorted by expert + bias [experts, out] of each row's expert (rows past the experts' ranges: not
    defined). The bias gradient is a per-expert sum over contiguous rows (Triton on CUDA, no atomics)."""
    return _GroupedBias.apply(x, bias, tokens_per_expert, x.is_cuda if use_kernel is None else use_kernel)
