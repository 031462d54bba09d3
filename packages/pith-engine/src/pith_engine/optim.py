"""AdamW and learning-rate schedules."""
import math

import torch
from pith_ops.adamw import adamw_update

from pith_engine.data_parallel import local_part

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


class AdamW(torch.optim.AdamW):
    """torch's fused AdamW (its arguments, state and checkpoints), stepping each tensor with pith_ops' one-kernel
    update (adamw_update) where use_kernel (default: the parameters are on CUDA). In Qwen3's step on the H200
    (4 layers, 3.1 B parameters) the update took 11.9 ms in bf16 and 23.1 in fp32, where torch's fused
    AdamW took 19 and 25 (bench/RESULTS.md). grad_scale and found_inf set as attributes (clipped_step) act
    as in torch's: each gradient divided by the scale, the update and the step count skipped where found_inf
    is nonzero. A group's lr may be a 0-dim tensor, as in torch's: the kernel reads it on the GPU. compute_casts (a
    pith_engine.data_parallel.ComputeCasts whose copies are kept, set by keep_compute_copies): the kernel writes
    each parameter's bf16 copy as it updates the parameter, where the next forward would cast it anew."""

    def __init__(self, params, use_kernel: bool | None = None, **options):
        super().__init__(params, fused=True, **options)
        self.use_kernel, self.compute_casts = use_kernel, None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:   # as torch's: the closure computes the gradients this step uses
            with torch.enable_grad():
                loss = closure()
        self.update()
        return loss

    def update(self):
        """The step's work on the gradients at hand (Muon steps some groups its own way)."""
        self.adamw_step(self.param_groups)

    def adamw_step(self, groups: list[dict]):
        """The AdamW step of these param groups only (Muon steps its own groups, and these through this)."""
        with_grads = [(p, group) for group in groups for p in group["params"] if p.grad is not None]
        if not with_grads or not self.kernel_on(with_grads[0][0].device):
            every, self.param_groups = self.param_groups, groups   # torch's step reads param_groups
            try:
                super().step()
            finally:
                self.param_groups = every
            return
        device = with_grads[0][0].device
        grad_scale, found_inf = clip_flags(self, device)
        lrs = {id(group): lr_tensor(group["lr"], device) for group in groups}
        states = [self.state_of(p) for p, _ in with_grads]
        count_step(states, found_inf)
        casts = self.compute_casts
        for (p, group), state in zip(with_grads, states):
            adamw_update(*(local_part(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])), state["step"],
                         lrs[id(group)], group["betas"], group["eps"], group["weight_decay"], grad_scale, found_inf,
                         None if casts is None else casts.copy_to_update(p))

    def kernel_on(self, device: torch.device) -> bool:
        """Whether the step runs pith_ops' kernels (use_kernel; default: on CUDA) for parameters on device."""
        return device.type == "cuda" if self.use_kernel is None else self.use_kernel

    def state_of(self, param: torch.Tensor) -> dict:
        """The parameter's state, made as torch's fused AdamW makes it on the first step."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state


def clip_flags(optimizer: torch.optim.Optimizer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's gradient scale and skip flag as clipped_step set them on the optimizer (1 and 0 where it did not)."""
    grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
    return (torch.ones((), device=device) if grad_scale is None else grad_scale,
            torch.zeros((), device=device) if found_inf is None else found_inf)


def lr_tensor(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A group's learning rate as the kernels read it: a 0-dim tensor on device (a schedule's own, or one made)."""
    return lr if torch.is_tensor(lr) else torch.full((), lr, device=device)


def count_step(states: list[dict], found_inf: torch.Tensor):
    """Each state's step count + 1, but where found_inf is set."""
    # a list of 0-dim tensors: the one-tensor overload reads it on the host, which a CUDA graph cannot capture
    torch._foreach_add_([state["step"] for state in states], [1 - found_inf] * len(states))


def decay_groups(named: list[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """AdamW's two param groups of these (name, parameter) pairs: weight decay on matrices only (not norms, biases or
    1-d parameters: a stack of experts' biases, GPT-OSS's [E, n], is known by its name)."""
    decayed = {name for name, p in named if p.ndim >= 2 and not name.endswith("bias")}
    return [dict(params=[p for name, p in named if name in decayed], weight_decay=weight_decay),
            dict(params=[p for name, p in named if name not in decayed], weight_decay=0.0)]


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> AdamW:
    """AdamW with weight decay on matrices only (decay_groups); fused (one kernel per tensor on CUDA, torch's fused
    kernel over every tensor on CPU), as clipped_step needs."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return AdamW(decay_groups(named, weight_decay), lr=lr, betas=betas)


def clipped_step(optimizer: torch.optim.Optimizer, norm: torch.Tensor, max_norm: float, lr: torch.Tensor | None = None):
    """optimizer.step() on the gradients scaled so that their global norm (`norm`, from grad_norm) is at most
    max_norm, skipped when `norm` is not finite: weights and optimizer state stay as they were. The fused
    optimizer divides each gradient by the scale as it reads it (grad_scale) and skips on a device flag
    (found_inf): scaling first would read and write every gradient once more, and deciding to skip on the
    host would wait for the GPU to finish the backward. lr: a 0-dim tensor on the parameters' device, every
    group's learning rate for this step (None: each group's own); the groups get their own back after it."""
    if not optimizer.defaults.get("fused"):
        raise TypeError(f"clipped_step takes a fused torch optimizer (as adamw() makes), not {optimizer!r}")
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    own_lrs = [group["lr"] for group in optimizer.param_groups]
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
        for group, own in zip(optimizer.param_groups, own_lrs):
            group["lr"] = own
