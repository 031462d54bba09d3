"""Fused SwiGLU for expert MLPs: out = silu(gate) * up, with gate | up side by side in one tensor.

The expert GEMM writes gate and up as one [tokens, 2 * width] tensor (gate in the first half); the
kernel reads it once and writes [tokens, width], and the backward recomputes silu instead of saving it.
All arithmetic is fp32 whatever the storage dtype.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@triton.jit
def _swiglu_forward_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(gate_up_ptr, grad_out_ptr, grad_gate_up_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask).to(tl.float32)
    grad_out = tl.load(grad_out_ptr + row * width + cols, mask=mask).to(tl.float32)
    sig = tl.sigmoid(gate)
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    grad_gate = grad_out * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = grad_out * gate * sig
    dtype = grad_gate_up_ptr.dtype.element_ty
    tl.store(grad_gate_up_ptr + row * 2 * width + cols, grad_gate.to(dtype), mask=mask)
    tl.store(grad_gate_up_ptr + row * 2 * width + width + cols, grad_up.to(dtype), mask=mask)


def _grid(rows: int, width: int):
    return (rows, triton.cdiv(width, BLOCK))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gate_up = gate_up.contiguous()
        width = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], width)
        rows = out.numel() // width if width else 0
        if rows:
            _swiglu_forward_kernel[_grid(rows, width)](gate_up, out, width, BLOCK=BLOCK)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (gate_up,) = ctx.saved_tensors
        width = gate_up.shape[-1] // 2
        grad_gate_up = torch.empty_like(gate_up)
        rows = grad_out.numel() // width if width else 0
        if rows:
            _swiglu_backward_kernel[_grid(rows, width)](gate_up, grad_out.contiguous(), grad_gate_up, width, BLOCK=BLOCK)
        return grad_gate_up


def swiglu(gate_up: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * width]. The Triton kernel runs on CUDA tensors (or when
    use_kernel=True, e.g. under TRITON_INTERPRET=1 on CPU); elsewhere the torch reference runs."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: last dimension {gate_up.shape[-1]} must be even (gate | up halves)")
    if use_kernel if use_kernel is not None else gate_up.is_cuda:
        return _SwiGLU.apply(gate_up)
    return swiglu_reference(gate_up)
