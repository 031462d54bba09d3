"""Data parallelism with FSDP2, and the global gradient-norm clip.

Expert weights are sharded over dp x cp (expert-parallel ranks hold different experts); every other
weight over dp x cp x ep (expert-parallel ranks read different data, so they are data-parallel for those
weights). Parameters stay fp32 (the master copy the optimizer updates); compute runs in `param_dtype`;
gradients are reduced in fp32 as a sum, not a mean, because each rank's loss is already divided by the
global token count. After sharding, every parameter element lives on exactly one rank (per pipeline
stage), which is what makes the clip's all-reduced sum of squares exact.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from pith_engine.parallel import Parallel


def shard_model(model: torch.nn.Module, parallel: Parallel, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Apply FSDP2 in place, bottom-up: each layer's experts, each decoder layer, then the root (embedding,
    final norm, LM head). The model's layers run through their forward and the loss through loss_sum, so
    those are the entry points whose hooks gather and free the weights. One process: nothing to do."""
    if parallel.world == 1:
        return model
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    expert_mesh, dense_mesh = parallel.mesh_over("dp", "cp"), parallel.mesh_over("dp", "cp", "ep")
    for layer in model.model.layers:
        if layer.is_moe:   # rows (dim 1), so that each expert's slice of the stack is itself a row shard
            fully_shard(layer.mlp.experts, mesh=expert_mesh, mp_policy=policy, shard_placement_fn=lambda p: Shard(1))
        fully_shard(layer, mesh=dense_mesh, mp_policy=policy)
    fully_shard(model, mesh=dense_mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "loss_sum")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)   # plain SUM: gloo has no pre-multiplied sum
    return model


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most max_norm; returns the norm before. Each
    rank sums the squares of the gradient elements it holds; one all-reduce over the world adds them."""
    grads = [local_part(p.grad) for p in parameters if p.grad is not None]
    squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]).sum()
    if dist.is_initialized():
        dist.all_reduce(squares)
    norm = squares.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].dtype))
    return norm
