"""Fused SwiGLU for expert MLPs, in the two layouts the model families use.

swiglu: out = silu(gate) * up, with gate | up side by side in one [tokens, 2 * width] tensor (gate in
the first half): Qwen3-MoE, DeepSeek-V2.
clamped_swiglu (GPT-OSS): gate and up interleaved (gate = even columns, up = odd columns), clamped
(gate <= limit, -limit <= up <= limit), out = (up + 1) * gate * sigmoid(alpha * gate).

Both are out = gate * sigmoid(alpha * gate) * (up + shift), so one pair of kernels serves both; a
constexpr flag picks the layout and the clamps. The kernel reads gate_up once and writes
[tokens, width]; the backward recomputes the sigmoid instead of saving it. All arithmetic is fp32
whatever the storage dtype.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 2048


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def clamped_swiglu_reference(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    gate = gate_up.float()[..., 0::2].clamp(max=limit)
    up = gate_up.float()[..., 1::2].clamp(-limit, limit)
    return ((up + 1) * gate * torch.sigmoid(alpha * gate)).to(gate_up.dtype)


@triton.jit
def _load_gate_up(ptr, out_at, width, mask, CLAMPED: tl.constexpr):
    """gate and up (fp32) of the flat output elements out_at. Interleaved (GPT-OSS): one contiguous load of
    (gate, up) pairs, split in registers; halves: two contiguous loads."""
    if CLAMPED:
        pairs = tl.load(ptr + 2 * out_at[:, None] + tl.arange(0, 2)[None, :], mask=mask[:, None])
        gate, up = tl.split(pairs.to(tl.float32))
        return gate, up
    row, cols = out_at // width, out_at % width
    gate = tl.load(ptr + row * 2 * width + cols, mask=mask).to(tl.float32)
    return gate, tl.load(ptr + row * 2 * width + width + cols, mask=mask).to(tl.float32)


@triton.jit
def _store_gate_up(ptr, out_at, width, mask, gate, up, CLAMPED: tl.constexpr):
    dtype = ptr.dtype.element_ty
    if CLAMPED:
        tl.store(ptr + 2 * out_at[:, None] + tl.arange(0, 2)[None, :], tl.join(gate, up).to(dtype), mask=mask[:, None])
    else:
        row, cols = out_at // width, out_at % width
        tl.store(ptr + row * 2 * width + cols, gate.to(dtype), mask=mask)
        tl.store(ptr + row * 2 * width + width + cols, up.to(dtype), mask=mask)


@triton.jit
def _forward_kernel(gate_up_ptr, out_ptr, width, total, alpha, limit, CLAMPED: tl.constexpr, BLOCK: tl.constexpr):
    # flat over the [rows, width] output, so no lanes idle at row ends whatever the width
    out_at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = out_at < total
    gate, up = _load_gate_up(gate_up_ptr, out_at, width, mask, CLAMPED)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    out = gate * tl.sigmoid(alpha * gate) * up
    tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(gate_up_ptr, grad_out_ptr, grad_gate_up_ptr, width, total, alpha, limit,
                     CLAMPED: tl.constexpr, BLOCK: tl.constexpr):
    out_at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = out_at < total
    gate, up = _load_gate_up(gate_up_ptr, out_at, width, mask, CLAMPED)
    grad_out = tl.load(grad_out_ptr + out_at, mask=mask).to(tl.float32)
    # a clamp passes the gradient where its input lies inside the bounds (inclusive, as torch.clamp)
    gate_passes = 1.0
    up_passes = 1.0
    if CLAMPED:
        gate_passes = (gate <= limit).to(tl.float32)
        up_passes = ((up >= -limit) & (up <= limit)).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    sig = tl.sigmoid(alpha * gate)
    # d (g * sigmoid(a g)) / dg = sig * (1 + a * g * (1 - sig))
    grad_gate = grad_out * up * sig * (1.0 + alpha * gate * (1.0 - sig)) * gate_passes
    grad_up = grad_out * gate * sig * up_passes
    _store_gate_up(grad_gate_up_ptr, out_at, width, mask, grad_gate, grad_up, CLAMPED)


def _grid(total: int):
    return (triton.cdiv(total, BLOCK),)


# Custom ops (with fake implementations) rather than a plain autograd.Function: torch.compile sees them as
# opaque nodes of known shape, so a compiled graph that contains them never breaks.
def _launch_forward(gate_up: torch.Tensor, alpha: float, limit: float, clamped: bool) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    if out.numel():
        _forward_kernel[_grid(out.numel())](gate_up, out, width, out.numel(), alpha, limit, CLAMPED=clamped, BLOCK=BLOCK)
    return out


swiglu_forward = torch.library.custom_op("pith::swiglu_forward", _launch_forward, mutates_args=())


@swiglu_forward.register_fake
def _(gate_up, alpha, limit, clamped):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _launch_backward(gate_up: torch.Tensor, grad_out: torch.Tensor, alpha: float, limit: float,
                     clamped: bool) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    grad_gate_up = torch.empty_like(gate_up)
    if grad_out.numel():
        _backward_kernel[_grid(grad_out.numel())](gate_up, grad_out.contiguous(), grad_gate_up, gate_up.shape[-1] // 2,
                                                  grad_out.numel(), alpha, limit, CLAMPED=clamped, BLOCK=BLOCK)
    return grad_gate_up


swiglu_backward = torch.library.custom_op("pith::swiglu_backward", _launch_backward, mutates_args=())


@swiglu_backward.register_fake
def _(gate_up, grad_out, alpha, limit, clamped):
    return torch.empty_like(gate_up)


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.alpha, ctx.limit, ctx.clamped = inputs[1:]


def _backward(ctx, grad_out):
    return swiglu_backward(ctx.saved_tensors[0], grad_out, ctx.alpha, ctx.limit, ctx.clamped), None, None, None


swiglu_forward.register_autograd(_backward, setup_context=_save_input)


class _SwiGLU(torch.autograd.Function):
    """The custom op's kernels without the dispatcher: in eager code each custom-op call costs ~0.2 ms of
    CPU, which leaves the GPU idle between the expert kernels; compiled graphs use the custom op."""

    @staticmethod
    def forward(ctx, gate_up, alpha, limit, clamped):
        ctx.save_for_backward(gate_up)
        ctx.alpha, ctx.limit, ctx.clamped = alpha, limit, clamped
        return _launch_forward(gate_up, alpha, limit, clamped)

    @staticmethod
    def backward(ctx, grad_out):
        grad = _launch_backward(ctx.saved_tensors[0], grad_out, ctx.alpha, ctx.limit, ctx.clamped)
        return grad, None, None, None


def _swiglu_kernel(gate_up, alpha: float, limit: float, clamped: bool):
    if torch.compiler.is_compiling():
        return swiglu_forward(gate_up, alpha, limit, clamped)
    return _SwiGLU.apply(gate_up, alpha, limit, clamped)


def _check_even(name: str, gate_up: torch.Tensor):
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{name}: last dimension {gate_up.shape[-1]} must be even (gate and up columns)")


def swiglu(gate_up: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * width]. The Triton kernel runs on CUDA tensors (or when
    use_kernel=True, e.g. under TRITON_INTERPRET=1 on CPU); elsewhere the torch reference runs."""
    _check_even("swiglu", gate_up)
    if use_kernel if use_kernel is not None else gate_up.is_cuda:
        return _swiglu_kernel(gate_up, 1.0, 0.0, False)
    return swiglu_reference(gate_up)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0,
                   use_kernel: bool | None = None) -> torch.Tensor:
    """GPT-OSS: (clamp(up) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), for gate_up = [..., 2 * width]
    holding gate in the even columns and up in the odd ones. Kernel dispatch as in `swiglu`."""
    _check_even("clamped_swiglu", gate_up)
    if use_kernel if use_kernel is not None else gate_up.is_cuda:
        return _swiglu_kernel(gate_up, float(alpha), float(limit), True)
    return clamped_swiglu_reference(gate_up, alpha, limit)
