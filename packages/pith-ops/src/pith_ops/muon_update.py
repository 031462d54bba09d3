"""Muon's two elementwise passes over a tensor, each one Triton kernel: the momentum (read the gradient and the
momentum buffer once, write the buffer and the update to orthogonalize once) and the update of the weight (read
the weight and the orthogonalized update once, write the weight once). As torch ops (pith_engine.muon's path on
the CPU) the same two passes are eleven elementwise kernels, each reading or writing whole tensors; bench/muon.py
times both ways.

As pith_ops.adamw: the math in fp32, the gradient divided by grad_scale and nothing written where found_inf is
nonzero (both read on the GPU, so a CUDA graph captures the step), the learning rate a 0-dim tensor.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _momentum_kernel(grad_ptr, buffer_ptr, update_ptr, scale_ptr, skip_ptr, n, momentum, NESTEROV: tl.constexpr,
                     BLOCK: tl.constexpr):
    if tl.load(skip_ptr) != 0:
        return
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32) / tl.load(scale_ptr).to(tl.float32)
    buffer = momentum * tl.load(buffer_ptr + offsets, mask=inside).to(tl.float32) + grad
    update = grad + momentum * buffer if NESTEROV else buffer
    tl.store(buffer_ptr + offsets, buffer.to(buffer_ptr.dtype.element_ty), mask=inside)
    tl.store(update_ptr + offsets, update.to(update_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _apply_kernel(param_ptr, orthogonal_ptr, lr_ptr, skip_ptr, n, weight_decay, scale, BLOCK: tl.constexpr):
    if tl.load(skip_ptr) != 0:
        return
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    lr = tl.load(lr_ptr).to(tl.float32)
    param = tl.load(param_ptr + offsets, mask=inside).to(tl.float32)
    orthogonal = tl.load(orthogonal_ptr + offsets, mask=inside).to(tl.float32)
    param = param * (1 - lr * weight_decay) - lr * scale * orthogonal
    tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=inside)


def check_alike(name: str, first: torch.Tensor, *others: torch.Tensor):
    if not all(t.is_contiguous() for t in (first, *others)) or any(t.shape != first.shape for t in others):
        raise ValueError(f"{name}: the tensors must be contiguous and of one shape, not "
                         f"{[tuple(t.shape) for t in (first, *others)]}")


def muon_momentum(grad: torch.Tensor, buffer: torch.Tensor, update: torch.Tensor, momentum: float, nesterov: bool,
                  grad_scale: torch.Tensor, found_inf: torch.Tensor, block: int = 4096, num_warps: int = 8):
    """In place, where found_inf is 0 (elsewhere nothing is written): with G = grad / grad_scale,
    buffer <- momentum * buffer + G, and update (any float dtype: Newton-Schulz's) <- G + momentum * buffer
    (nesterov) or buffer. grad_scale and found_inf: 0-dim tensors on the tensors' device."""
    check_alike("muon_momentum", grad, buffer, update)
    _momentum_kernel[(triton.cdiv(grad.numel(), block),)](grad, buffer, update, grad_scale, found_inf, grad.numel(),
                                                          momentum, NESTEROV=nesterov, BLOCK=block,
                                                          num_warps=num_warps)


def muon_apply(param: torch.Tensor, orthogonal: torch.Tensor, lr: torch.Tensor, weight_decay: float, scale: float,
               found_inf: torch.Tensor, block: int = 4096, num_warps: int = 8):
    """In place, where found_inf is 0: param <- param * (1 - lr * weight_decay) - lr * scale * orthogonal (any float
    dtype). lr and found_inf: 0-dim tensors on the tensors' device."""
    check_alike("muon_apply", param, orthogonal)
    _apply_kernel[(triton.cdiv(param.numel(), block),)](param, orthogonal, lr, found_inf, param.numel(),
                                                        weight_decay, scale, BLOCK=block, num_warps=num_warps)
