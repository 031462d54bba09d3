"""torch.compile of the dense stages of every decoder layer.

An MoE layer's stage 1 (attention_stage: norms, attention, router) is compiled; its experts and the
dispatch / combine between them stay eager, because their shapes depend on the routing. Stage 5 (aggregate_stage:
a residual add, or DeepSeek's shared experts too) runs eagerly too: a compiled call cost the host 0.22 ms for
Qwen3's one add kernel on the H200, where the forward left the GPU waiting for the host (bench/RESULTS.md).
A dense layer (is_moe False) is compiled whole. fullgraph=True makes a graph break an error instead of a silent
slowdown, except in a layer that says it calls what dynamo cannot trace (layer.fullgraph False: Qwen3.5's fla-core
delta rule, which its package marks torch.compiler.disable; FSDP2's hooks of a float32 parameter's own unit,
pith_engine.data_parallel.shard); dynamic=False because sequence length and batch are
fixed in training.
Layers of one family share their compiled code: parameters are graph inputs, not constants.
"""
import torch

from pith_engine.contract import MoeModel


def compile_stages(model: MoeModel) -> MoeModel:
    """Compile, in place, the dense stages of model.layers; returns the model."""
    # A stage that --recompute checkpoints (pith_engine.recompute) counts its routing in a buffer (LoadBalance): the
    # compiled backward recomputes tensors only, so that count is made once, in the forward, as eagerly.
    once_in_recompute = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
    for layer in model.layers.values():
        if layer.is_moe:
            layer.attention_stage = once_in_recompute(torch.compile(layer.attention_stage, fullgraph=layer.fullgraph,
                                                                    dynamic=False))
        else:
            layer.compile(fullgraph=getattr(layer, "fullgraph", True), dynamic=False)
    return model
