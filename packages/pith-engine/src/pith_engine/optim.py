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
    """AdamW with weight decay on matrices only (not norms, biases or 1-d parameters); fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.ndim >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0)]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
