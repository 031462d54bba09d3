"""AdamW and learning-rate schedules."""
import math

import torch

SCHEDULES = ("cosine", "wsd", "constant")
WSD_DECAY_FRACTION = 0.2   # warmup-stable-decay: the last 20% of the steps decay


def lr_at(step: int, base_lr: float, warmup: int, total: int, schedule: str, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then to min_ratio * base_lr at `total`: a cosine ("cosine"), a
    constant stretch then a linear decay over the last WSD_DECAY_FRACTION of the steps ("wsd"), or no
    decay at all ("constant")."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant":
        return base_lr
    if schedule == "wsd":
        decay = max(1, round(WSD_DECAY_FRACTION * total))
        progress = min(1.0, max(0, step - (total - decay)) / decay)
        return base_lr * (1 - (1 - min_ratio) * progress)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases or 1-d parameters); fused (one kernel over
    every tensor, on CUDA and CPU), as clipped_step needs."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.ndim >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


def clipped_step(optimizer: torch.optim.Optimizer, norm: torch.Tensor, max_norm: float):
    """optimizer.step() on the gradients scaled so that their global norm (`norm`, from grad_norm) is at most
    max_norm, skipped when `norm` is not finite: weights and optimizer state stay as they were. The fused
    optimizer divides each gradient by the scale as it reads it (grad_scale) and skips on a device flag
    (found_inf): scaling first would read and write every gradient once more, and deciding to skip on the
    host would wait for the GPU to finish the backward."""
    if not optimizer.defaults.get("fused"):
        raise TypeError(f"clipped_step takes a fused torch optimizer (as adamw() makes), not {optimizer!r}")
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
