"""AdamW and learning-rate schedules."""
import math

import torch

SCHEDULES = ("cosine", "constant")


def lr_at(step: int, base_lr: float, warmup: int, total: int, schedule: str, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine decay to min_ratio * base_lr at `total`."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant":
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases or 1-d parameters); fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.ndim >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0)]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
