"""Activation recompute: how much of a decoder layer's forward the backward runs again instead of keeping it.

- "none": every stage keeps what its backward reads.
- "selective": each region of a layer (an MoE layer's stage 1, attention and router; its experts between the
  two all-to-alls: the gather into expert order, stage 3, the weighted sum over them; stage 5's shared experts;
  a dense layer whole) keeps the outputs of its products (matmuls, grouped GEMMs, attention) and recomputes the
  rest (norms, rotary, SwiGLU activations, softmaxes, the gather), cheap in time and much of the memory.
- "full": each region keeps only its inputs: the layer's input, the tokens the experts received (before their
  gather) and the routing are what the backward finds.
Communication is never run twice: an all-to-all (dispatch, combine) lies between the recomputed regions, and the
functional collectives inside one (load balancing's all-reduce of expert counts) are kept, not recomputed. A region
recomputed eagerly runs again with its side effects off (a LoadBalance counts and accumulates a forward's routing
once: `replaying`) and with the weights it computed with (one process's mixed precision swaps the bf16 copies
back in: ComputeCasts); a compiled region is recomputed inside its compiled backward, which runs no Python.
"""
import contextlib
import functools

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pith_engine.contract import MoeModel
from pith_engine.moe import LoadBalance, local_experts

MODES = ("none", "selective", "full")

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
COLLECTIVES = {c10d.all_reduce.default, c10d.wait_tensor.default, c10d.all_gather_into_tensor.default,
               c10d.reduce_scatter_tensor.default}
# the products selective keeps: GEMMs and the attention kernels that hold no scores (the math attention's bmm
# scores, [seq x seq] per head, are recomputed)
PRODUCTS = {aten.mm.default, aten.addmm.default, aten._grouped_mm.default, aten._scaled_mm.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default}


# FSDP2's hooks around an experts module inside a region mark their work for the profiler, as many times in a recompute
# as its state then asks: markers, not results, which selective checkpointing would otherwise count and match
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})


def keep(saved: frozenset):
    """The selective-checkpoint policy that keeps the outputs of the ops in `saved` and recomputes the others."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def recompute_stages(model: MoeModel, mode: str) -> MoeModel:
    """Set, in place, what model.layers recompute in the backward (MODES); call before compile_stages, which then
    compiles the recomputed stages. Returns the model."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is unknown; valid: {', '.join(MODES)}")
    if mode == "none":
        return model
    saved = frozenset(COLLECTIVES | (PRODUCTS if mode == "selective" else set()))
    for layer in model.layers.values():
        if not layer.is_moe:
            layer.forward = recomputed(layer.forward, layer, model, saved)
            continue
        layer.attention_stage = recomputed(layer.attention_stage, layer, model, saved)
        layer.aggregate_stage = functools.partial(aggregate, recomputed(shared_part(layer.aggregate_stage), layer,
                                                                          model, saved))
        layer.recomputed_experts = recomputed(functools.partial(local_experts, layer), layer, model, saved)
    return model


def shared_part(aggregate_stage):
    """What stage 5 adds besides hidden and the routed sum (the contract: it returns their sum plus the shared
    experts' output), as a function of the tokens alone: recomputed, it keeps the tokens, not hidden and routed."""
    def shared(tokens, shape):
        return aggregate_stage(tokens.new_zeros(shape), tokens, tokens.new_zeros(tokens.shape))
    return shared


def aggregate(shared, hidden, tokens, routed):
    """Stage 5 from its recomputed shared part, added in the families' order (the same roundings)."""
    return hidden + (routed.view_as(hidden) + shared(tokens, hidden.shape))


def recomputed(stage, layer, model, saved: frozenset):
    """stage(*args) checkpointed: what it saves for the backward is `saved` ops' outputs and its inputs; the rest
    is recomputed when the backward needs it. Without gradients (evaluation) it runs plainly."""
    compiled = functools.partial(create_selective_checkpoint_contexts, keep(saved))   # what dynamo traces

    def eager():
        forward, recompute = compiled()
        return forward, replaying(recompute, layer, getattr(model, "compute_casts", None))

    @functools.wraps(stage)
    def run(*args):
        if not torch.is_grad_enabled():
            return stage(*args)
        return checkpoint(stage, *args, use_reentrant=False, preserve_rng_state=False,
                          context_fn=compiled if torch.compiler.is_compiling() else eager)
    return run


@contextlib.contextmanager
def replaying(recompute, layer, casts):
    """An eager recompute of part of `layer`: its load balancing does not count the routing again, and under one
    process's mixed precision its fp32 parameters are swapped for the bf16 copies the forward computed with."""
    balances = [m for m in layer.modules() if isinstance(m, LoadBalance)]
    swapped = [] if casts is None else [(m, name, p) for m in layer.modules() for name, p in m._parameters.items()
                                        if p is not None and p.dtype == torch.float32]
    for module, name, param in swapped:
        module._parameters[name] = casts.copy_of(param)
    for balance in balances:
        balance.replaying = True
    try:
        with recompute:
            yield
    finally:
        for balance in balances:
            balance.replaying = False
        for module, name, param in swapped:
            module._parameters[name] = param
