"""The engine-model contract: everything pith_engine reads of a model, written down once.

A family's top-level model is a `MoeModel`; each of its decoder layers (`model.layers`) is a `DenseLayer` or
a `MoeLayer` (`is_moe` says which), and an MoE layer's `experts` module is an `ExpertStack`. Engine
functions take these types and read nothing else of a model but which parameters a module declares to compute in
float32 (`fp32_names`): no attribute path (`model.model.layers`, `mlp.experts`) and no parameter-name pattern.
`check_model` says what a model lacks; tests/apps/test_contract.py runs it on each family.
"""
from typing import Protocol

import torch
from torch import nn


class ExpertStack(Protocol):
    """A layer's experts on this rank: global experts first_expert .. first_expert + local_experts - 1,
    stacked along dim 0 of each of its parameters."""
    local_experts: int
    first_expert: int
    ep_group: object    # the expert-parallel process group dispatch sends over; None: every expert is here
    wgrad_pairs: object   # a pith_ops.grouped_gemm.WgradPairs its weight gradients go through, or None
    wgrad_queue: object   # where its weight gradients are queued to run later (grouped_linear's), or None


class DenseLayer(Protocol):
    """A decoder layer without experts (is_moe False), called as layer(x, *layer_args) by the model's forward."""
    is_moe: bool

    def __call__(self, x: torch.Tensor, *layer_args) -> torch.Tensor: ...


class MoeLayer(Protocol):
    """A decoder layer with experts (is_moe True), run as five stages by pith_engine.moe.run_moe_layer: the
    model writes stages 1, 3 and 5, the engine dispatches (2) and combines (4) between them."""
    is_moe: bool
    num_experts: int      # over all expert-parallel ranks
    experts: ExpertStack
    fullgraph: bool       # torch.compile traces attention_stage whole (False: it calls what dynamo must skip: a kernel,
                          # or under FSDP the hooks of a float32 parameter's own unit, fp32_names)

    def attention_stage(self, x: torch.Tensor, *layer_args) -> tuple:
        """-> (hidden [batch, seq, hidden] after attention and its residual, tokens [batch * seq, hidden]
        the experts' input, pith_engine.moe.Routing)."""

    def expert_stage(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor: ...

    def aggregate_stage(self, hidden: torch.Tensor, tokens: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """-> the layer's output, hidden + (routed + shared): routed the routed sum [batch * seq, hidden], shared the
        shared experts' output of tokens (0 without them). Activation recompute evaluates shared alone, as
        aggregate_stage(0, tokens, 0) (pith_engine.recompute)."""


class MoeModel(Protocol):
    """A causal LM whose forward is the one entry point that mixed precision and FSDP hook, for the whole model
    (loss_sum) and for each pipeline chunk (forward with hidden and layers)."""
    layers: dict[int, nn.Module]   # the decoder layers this process holds (a pipeline rank: its chunks'), by number
    hidden_size: int      # of the hidden states between layers
    wgrad_pairs: object   # the WgradPairs its step flushes after the last backward (pith_engine.data_parallel)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, docs: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, layers: list[int] | None = None) -> torch.Tensor:
        """`layers` (default all) on `hidden` (default the embedding of input_ids): their output hidden states,
        or, after the last layer, the token-summed fp32 cross-entropy over labels != -100 (logits without labels)."""

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor, docs: torch.Tensor | None = None
                 ) -> torch.Tensor: ...


def moe_layers(model: MoeModel) -> list[MoeLayer]:
    return [layer for layer in model.layers.values() if layer.is_moe]


def wgrad_queue_holders(model: MoeModel) -> list[nn.Module]:
    """The modules of the decoder layers that take a `wgrad_queue` to defer their weight gradients to (each
    ExpertStack, and dense linears that can: pith_apps' Linear)."""
    return [module for layer in model.layers.values() for module in layer.modules() if hasattr(module, "wgrad_queue")]


def expert_stacks(model: MoeModel) -> dict[str, ExpertStack]:
    """Each MoE layer's experts module by its module name in the model (its parameters' name prefix)."""
    stacks = {id(layer.experts) for layer in moe_layers(model)}
    return {name: module for name, module in model.named_modules() if id(module) in stacks}


def fp32_names(module: nn.Module) -> list[str]:
    """The names of module's own parameters that compute in float32 whatever the compute dtype: those its `declared`
    dict (name -> a declaration with a bool `fp32`: pith_apps.models.layers.declare) marks so. Mixed precision
    (pith_engine.data_parallel) keeps them out of its bf16 casts."""
    return [name for name, declared in getattr(module, "declared", {}).items()
            if declared.fp32 and module._parameters.get(name) is not None]


def check_model(model) -> None:
    """TypeError naming the first part of the contract `model` does not meet."""
    _require(model, MoeModel, type(model).__name__)
    for n, layer in model.layers.items():
        _require(layer, MoeLayer if getattr(layer, "is_moe", False) else DenseLayer, f"layer {n} ({type(layer).__name__})")
        if layer.is_moe:
            _require(layer.experts, ExpertStack, f"layer {n}'s experts ({type(layer.experts).__name__})")


def _require(obj, protocol, what: str):
    members = [*protocol.__annotations__, *(name for name, value in vars(protocol).items()
                                            if callable(value) and not name.startswith("_"))]
    missing = [name for name in members if not hasattr(obj, name)]
    if missing:
        raise TypeError(f"{what} is not a pith_engine {protocol.__name__}: it lacks {', '.join(missing)}")
