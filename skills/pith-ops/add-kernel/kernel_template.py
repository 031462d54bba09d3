"""A complete small kernel to copy as packages/pith-ops/src/pith_ops/NAME.py: out = x * scale[row] and its
backward, with its torch reference beside it, an autograd Function over the launchers and one entry point that
picks the kernel on CUDA tensors and the reference elsewhere (use_kernel overrides: the tests force the kernel
under Triton's interpreter on CPU). All arithmetic is fp32 whatever the storage dtype."""
import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLS = 16, 128


def scale_rows_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale.float()[:, None]).to(x.dtype)


@triton.jit
def _forward_kernel(x_ptr, scale_ptr, out_ptr, rows, cols, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * cols + c[None, :], mask=inside, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + r, mask=r < rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + r[:, None].to(tl.int64) * cols + c[None, :], (x * s[:, None]).to(out_ptr.dtype.element_ty),
             mask=inside)


@triton.jit
def _backward_kernel(x_ptr, scale_ptr, grad_ptr, grad_x_ptr, grad_scale_ptr, rows, cols, BR: tl.constexpr,
                     BC: tl.constexpr):
    """grad_x = grad * scale[row]; grad_scale[row] = sum over the row of grad * x, one program per row block
    looping over the columns (no atomics: the sum of a row is one program's)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    s = tl.load(scale_ptr + r, mask=r < rows, other=0.0).to(tl.float32)
    total = tl.zeros((BR,), dtype=tl.float32)
    for c0 in range(0, cols, BC):
        c = c0 + tl.arange(0, BC)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        at = r[:, None].to(tl.int64) * cols + c[None, :]
        x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + at, mask=inside, other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + at, (grad * s[:, None]).to(grad_x_ptr.dtype.element_ty), mask=inside)
        total += tl.sum(grad * x, axis=1)
    tl.store(grad_scale_ptr + r, total.to(grad_scale_ptr.dtype.element_ty), mask=r < rows)


def _forward(x, scale):
    out = torch.empty_like(x)
    grid = (triton.cdiv(x.shape[0], BLOCK_ROWS), triton.cdiv(x.shape[1], BLOCK_COLS))
    _forward_kernel[grid](x, scale, out, x.shape[0], x.shape[1], BR=BLOCK_ROWS, BC=BLOCK_COLS)
    return out


def _backward(x, scale, grad):
    grad_x, grad_scale = torch.empty_like(x), torch.empty_like(scale)
    _backward_kernel[(triton.cdiv(x.shape[0], BLOCK_ROWS),)](x, scale, grad, grad_x, grad_scale, x.shape[0],
                                                              x.shape[1], BR=BLOCK_ROWS, BC=BLOCK_COLS)
    return grad_x, grad_scale


class _ScaleRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        return _forward(x, scale)

    @staticmethod
    def backward(ctx, grad):
        return _backward(*ctx.saved_tensors, grad.contiguous())


def scale_rows(x: torch.Tensor, scale: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """x [rows, cols] times scale [rows], row by row."""
    if not (x.is_cuda if use_kernel is None else use_kernel):
        return scale_rows_reference(x, scale)
    return _ScaleRows.apply(x.contiguous(), scale.contiguous())
