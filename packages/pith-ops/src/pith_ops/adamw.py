"""One AdamW update of one tensor in one Triton kernel: each element of the parameter, its gradient and the two
moments is read once and written once, in the tensors' own dtype, the math in fp32.

The update matches torch's fused AdamW (decoupled weight decay, bias-corrected moments, the gradient divided by
an optional grad_scale and the update skipped where found_inf is nonzero), with the step count, the learning
rate, the scale and the skip flag read on the GPU, so nothing waits for the host and a CUDA graph of the step
follows a learning-rate schedule. Given a compute copy (mixed precision's bf16 weights), the kernel writes the
updated parameter into it too.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, step_ptr, lr_ptr, scale_ptr, skip_ptr, n,
                  beta1, beta2, eps, weight_decay, WRITE_COPY: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(skip_ptr) != 0:
        return
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    step = tl.load(step_ptr).to(tl.float32)
    lr = tl.load(lr_ptr).to(tl.float32)
    correction1 = 1 - tl.exp(step * tl.log(beta1))
    correction2 = 1 - tl.exp(step * tl.log(beta2))
    grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32) / tl.load(scale_ptr).to(tl.float32)
    param = tl.load(param_ptr + offsets, mask=inside).to(tl.float32)
    exp_avg = beta1 * tl.load(exp_avg_ptr + offsets, mask=inside).to(tl.float32) + (1 - beta1) * grad
    exp_avg_sq = beta2 * tl.load(exp_avg_sq_ptr + offsets, mask=inside).to(tl.float32) + (1 - beta2) * grad * grad
    param = param * (1 - lr * weight_decay) - lr * (exp_avg / correction1) / (tl.sqrt(exp_avg_sq / correction2) + eps)
    param = param.to(param_ptr.dtype.element_ty)
    tl.store(param_ptr + offsets, param, mask=inside)
    if WRITE_COPY:
        tl.store(copy_ptr + offsets, param.to(copy_ptr.dtype.element_ty), mask=inside)
    tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=inside)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=inside)


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: torch.Tensor, lr: torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: float,
                 grad_scale: torch.Tensor, found_inf: torch.Tensor, copy: torch.Tensor | None = None, block: int = 4096,
                 num_warps: int = 8):
    """In place: param, exp_avg and exp_avg_sq after one AdamW step of count `step` (a 0-dim tensor, already
    counting this step) on grad / grad_scale, none of it where found_inf != 0; copy (a compute copy of param in
    another dtype, or None): the updated param in copy's dtype, as a cast after the step would write it, without
    reading param again. All these tensors contiguous, of one shape; step, lr, grad_scale and found_inf 0-dim
    tensors on their device."""
    copy_or_param = param if copy is None else copy   # the kernel's copy pointer, stored to only given a copy
    if not all(t.is_contiguous() and t.shape == param.shape for t in (grad, exp_avg, exp_avg_sq, copy_or_param)):
        raise ValueError(f"adamw_update: parameter {tuple(param.shape)}, its gradient, moments and compute copy must "
                         "be contiguous tensors of that shape")
    _adamw_kernel[(triton.cdiv(param.numel(), block),)](param, grad, exp_avg, exp_avg_sq, copy_or_param, step, lr, grad_scale, found_inf, param.numel(), betas[0],
                                                        betas[1], eps, weight_decay, copy is not None, BLOCK=block,
                                                        num_warps=num_warps)
