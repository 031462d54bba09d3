"""Building blocks that several model families use in exactly the same way: how a module declares its parameters
(`declare`), RMSNorm, rotary embeddings (plain and YaRN), the stacked SwiGLU experts of Qwen3-MoE and DeepSeek-V2,
and the top-level model's init / logits / loss / Hugging Face views. Each model file still instantiates its own
layers from these; anything a family does differently stays in its own file."""
import functools
import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pith_ops.cross_entropy import linear_cross_entropy
from pith_ops.fp8 import fp8_linear, traced_fp8_linear
from pith_ops.grouped_gemm import deferred_linear, grouped_linear
from pith_ops.swiglu import swiglu
from pith_engine.context_parallel import ring_attention, zigzag_positions
from pith_engine.data_parallel import embedding, local_part, this_ranks_part
from pith_engine.moe import run_moe_layer
from pith_engine.parallel import LayoutError, Parallel

RULES = ("normal", "zeros", "ones", "normal_per_expert")


@dataclass(frozen=True)
class Declared:
    """How one parameter starts (`rule`), whether Hugging Face files hold it (`hf`), whether it computes in float32
    whatever the compute dtype (`fp32`)."""
    rule: str | Callable
    hf: bool = True
    fp32: bool = False


def declare(module: nn.Module, hf: bool = True, fp32: bool = False, **rules) -> nn.Module:
    """Declare how module's own parameters start, by name: "normal" (normal(0, initializer_range)), "zeros", "ones",
    "normal_per_expert" (an experts module's stack, each expert drawn alone) or a function of the normal draw
    returning the full tensor; `CausalLM.init_weights` draws each from (seed, its full name), the same under every
    layout. Kept on the module (`declared`), not on the Parameter objects, which to_empty and FSDP2 replace; a name
    without a parameter (nn.Linear's bias=False) is skipped. hf=False: Hugging Face files may lack the parameters (at
    --init they keep this start, said in one line; exports write them, so our own folders round-trip).
    fp32=True: they compute in float32 under a bf16 compute dtype too (pith_engine.contract.fp32_names). -> module."""
    bad = [name for name, rule in rules.items() if not (callable(rule) or rule in RULES)]
    if bad:
        raise ValueError(f"declare({type(module).__name__}, {bad[0]}={rules[bad[0]]!r}): not a rule; valid: "
                         f"{', '.join(RULES)}, or a function of the draw")
    vars(module).setdefault("declared", {}).update({name: Declared(rule, hf, fp32) for name, rule in rules.items()})
    return module


class RMSNorm(nn.Module):
    """Normalize in fp32. Qwen3 and DeepSeek cast back to the input dtype before the weight multiply;
    GPT-OSS multiplies in fp32 first (scale_in_fp32=True). Same result in fp32, not in bf16."""

    def __init__(self, dim: int, eps: float, scale_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.scale_in_fp32 = eps, scale_in_fp32
        declare(self, weight="ones")

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_fp32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rope_parameters(data: dict) -> dict:
    """The rotary settings of a config.json wherever they are kept: top-level rope_theta and rope_scaling
    (published checkpoints) or one rope_parameters dict (what transformers v5 writes)."""
    params = dict(data.get("rope_scaling") or {})
    params.update(data.get("rope_parameters") or {})
    if "rope_theta" in data:
        params.setdefault("rope_theta", data["rope_theta"])
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def default_inv_freq(dim: int, theta: float, device=None) -> torch.Tensor:
    """Made on the device that uses it: a copy from host memory each forward could not be captured in a CUDA graph."""
    return theta ** -(torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_position: int, beta_fast: float,
                  beta_slow: float, truncate: bool, device=None) -> torch.Tensor:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, blend linearly between the
    dimensions whose wavelengths fit beta_fast and beta_slow times in the original context."""
    def correction_dim(rotations):
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if high == low:
        high += 0.001  # a ramp of zero width would divide by zero
    extrapolated = default_inv_freq(dim, theta, device)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos and sin for the rotate-half layout (each frequency appears twice): [seq, dim] for positions [seq],
    [batch, 1, seq, dim] (one for all heads) for per-sequence positions [batch, seq]; inv_freq on their device."""
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    if positions.dim() == 2:
        angles = angles[:, None]
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def document_starts(docs: torch.Tensor) -> torch.Tensor:
    """[batch, seq] bool: the first token of each document (docs: each token's document index), a row's first too."""
    return F.pad(docs[:, 1:] != docs[:, :-1], (1, 0), value=True)


def token_positions(input_ids: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
    """[seq] positions, or with docs (the document index of each token, [batch, seq], non-decreasing along a
    sequence) each token's position within its own document, [batch, seq]."""
    index = torch.arange(input_ids.shape[1], device=input_ids.device)
    if docs is None:
        return index
    return index - torch.where(document_starts(docs), index, 0).cummax(1).values


def visible(seq: int, device, docs: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """[seq, seq] (or [batch, 1, seq, seq] with docs) bool: query i sees key j when j <= i, within the sliding
    window (i - j < window) and, with docs, of the same document."""
    position = torch.arange(seq, device=device)
    offset = position[:, None] - position[None, :]
    seen = (offset >= 0) & (offset < window) if window else offset >= 0
    if docs is None:
        return seen
    return seen & (docs[:, None, :, None] == docs[:, None, None, :])


def apply_rotary(x, cos, sin):
    """x [batch, heads, seq, dim]: rotate-half (NeoX) layout, pairs (i, i + dim/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def causal_attention(q, k, v, scale: float, enable_gqa: bool = False, docs: torch.Tensor | None = None, ring=None):
    """Causal SDPA, q [batch, heads, seq, dim], k and v [batch, kv_heads, seq, dim]; never materializes scores on GPU.
    With docs ([batch, seq] document index of each token) a token sees only its own document's, through a
    [batch, 1, seq, seq] mask, which rules out the flash and cuDNN kernels (--doc-mask costs that).
    The backend is torch's choice, made once per process at the first CUDA call: cuDNN first on Hopper and
    Blackwell, the only fast kernel there for MLA's query/key 192 vs value 128 head dims (bench/RESULTS.md).
    No sdpa_kernel context here: one around that first call restores, on exit, the order from before torch made
    its choice, which keeps the whole process off cuDNN (transformers' DeepSeek-V2 step then ran 1/3 slower).
    ring: the context-parallel group; q, k and v are then this rank's zigzag part of the sequence, and the keys
    and values of the others' parts come around the ring (pith_engine.context_parallel)."""
    if ring is not None:
        return ring_attention(q, (k, v), ring, scale)[0]
    if docs is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(q.shape[2], q.device, docs), scale=scale,
                                              enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)


class MoeDecoderLayer(nn.Module):
    """What the families' MoE decoder layers share: forward runs the five stages through
    pith_engine.moe.run_moe_layer (one call per layer, so FSDP's hooks see the whole layer), stage 3 is the
    layer's experts module and stage 5 adds the routed sum to the residual. A family writes
    attention_stage and overrides what it does differently."""
    is_moe = True
    fullgraph = True

    def forward(self, x, cos, sin, docs=None):
        return run_moe_layer(self, x, cos, sin, docs)

    def expert_stage(self, x, tokens_per_expert):
        return self.mlp.experts(x, tokens_per_expert)

    def aggregate_stage(self, hidden, tokens, routed):
        return hidden + routed.view_as(hidden)

    @property
    def experts(self):
        return self.mlp.experts


class LocalExperts(nn.Module):
    """Experts module base: this rank holds experts first_expert .. first_expert + local_experts - 1 of
    num_experts, the expert-parallel group's share (all of them on one process). wgrad_pairs: the
    grouped_linear weight-gradient pairing of micro-batches (pith_engine.data_parallel.pair_expert_wgrads);
    wgrad_queue: where the weight gradients go to be run later (pith_engine.dualpipev.DeferredWeightGrads);
    fp8: the run's pith_ops.fp8.Fp8WeightCache under --fp8 (use_fp8), else None. gate_up_rows: how Muon orthogonalizes
    gate_up_proj's matrices (pith_engine.muon's SPLITS): the gate and up halves apart."""
    gate_up_rows = "halves"

    def __init__(self, num_experts: int, parallel: Parallel):
        super().__init__()
        self.local_experts = num_experts // parallel.ep
        self.first_expert = parallel.coords["ep"] * self.local_experts
        self.parallel = parallel
        self.wgrad_pairs = self.wgrad_queue = self.fp8 = None

    @functools.cached_property
    def ep_group(self):
        """The expert-parallel process group dispatch sends over (None: all experts are here); looked up on
        first use, so that a rank's experts can be built and loaded without a process group."""
        return self.parallel.group("ep")


class SwiGLUExperts(LocalExperts):
    """Experts of down(silu(gate(x)) * up(x)) stacked for grouped GEMMs: gate_up_proj [E, 2 * inter,
    hidden] (gate rows, then up rows) and down_proj [E, hidden, inter], E the local experts."""

    def __init__(self, num_experts: int, hidden: int, inter: int, parallel: Parallel):
        super().__init__(num_experts, parallel)
        self.inter = inter
        self.gate_up_proj = nn.Parameter(torch.empty(self.local_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.local_experts, hidden, inter))
        declare(self, gate_up_proj="normal_per_expert", down_proj="normal_per_expert")

    def forward(self, x, tokens_per_expert):
        gate_up = grouped_linear(x, self.gate_up_proj, tokens_per_expert, self.wgrad_queue, self.wgrad_pairs,
                                 fp8=self.fp8)
        return grouped_linear(swiglu(gate_up), self.down_proj, tokens_per_expert, self.wgrad_queue, self.wgrad_pairs,
                              fp8=self.fp8)

    def hf_views(self, prefix: str):
        """(Hugging Face name, view of our parameter) for each expert's gate/up/down weight."""
        for e in range(self.local_experts):
            name = f"{prefix}.{self.first_expert + e}"
            yield f"{name}.gate_proj.weight", self.gate_up_proj[e, :self.inter]
            yield f"{name}.up_proj.weight", self.gate_up_proj[e, self.inter:]
            yield f"{name}.down_proj.weight", self.down_proj[e]


class Linear(nn.Linear):
    """nn.Linear whose weight gradient a pipeline can defer: given a wgrad_queue (pith_engine.dualpipev's), the
    backward computes the input gradient and queues the weight's (deferred_linear). Given an Fp8WeightCache
    (`fp8`, use_fp8), its GEMMs run in FP8 (fp8_linear). Inside torch.compile, whose backward is one graph (a
    closure cannot be queued from it, nor a Python cache read), the weight gradient is not deferred, and under FP8 the
    GEMMs run through traced_fp8_linear, which quantizes the weight at each use. The weight starts normal, the bias
    at 0."""
    wgrad_queue = fp8 = None

    def __init__(self, inputs: int, outputs: int, bias: bool = True):
        super().__init__(inputs, outputs, bias)
        declare(self, weight="normal", bias="zeros")

    def forward(self, x):
        compiling = torch.compiler.is_compiling()
        if self.fp8 is not None:
            out = traced_fp8_linear(x, self.weight) if compiling else fp8_linear(x, self.weight, self.fp8,
                                                                                 self.wgrad_queue)
            return out if self.bias is None else out + self.bias
        if compiling or self.wgrad_queue is None:
            return super().forward(x)
        return deferred_linear(x, self.weight, self.bias, self.wgrad_queue)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): DeepSeek-V2's dense layers and shared experts, Qwen3.5-MoE's shared expert."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def use_fp8(model: nn.Module, cache, dense: bool = False) -> list[nn.Module]:
    """--fp8: the experts' GEMMs (and, dense: the dense linears of the decoder layers, Linear: not the routers or the
    LM head) compute through `cache` (a pith_ops.fp8.Fp8WeightCache, watching the optimizer), which the model holds as
    fp8_cache (for release_forward_weights to empty after an evaluation: blocks it made would outlive the step);
    the modules set."""
    kinds = (Linear, LocalExperts) if dense else LocalExperts
    modules = [m for layer in model.layers.values() for m in layer.modules() if isinstance(m, kinds)]
    for module in modules:
        module.fp8 = cache
    model.fp8_cache = cache
    return modules


def hidden_matrices(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The parameters --optimizer muon orthogonalizes, by how their rows split into matrices (pith_engine.muon's
    SPLITS): the weights of the decoder layers' dense linears (Linear: attention and MLA projections, dense and
    shared-expert MLPs, Qwen3.5's linear-attention projections; not the routers or gates, which are nn.Linear, nor
    the LM head), whole, and each expert stack's matrices ([experts, rows, columns], not GPT-OSS's [experts, n]
    biases), gate_up_proj as its experts' gate_up_rows says. Every other parameter is AdamW's:
    embeddings, LM head, norms, biases, routers, sinks, Qwen3.5's 1-d and convolution parameters."""
    modules = [m for layer in model.layers.values() for m in layer.modules()]
    matrices = {"whole": [m.weight for m in modules if isinstance(m, Linear)]}
    for m in modules:
        if isinstance(m, LocalExperts):
            for name, p in m.named_parameters(recurse=False):
                if p.ndim == 3:
                    matrices.setdefault(m.gate_up_rows if name == "gate_up_proj" else "whole", []).append(p)
    return matrices


class Embedding(nn.Embedding):
    """nn.Embedding whose gradient, under one-process mixed precision on CUDA, goes row by row into the fp32
    master gradient (pith_engine.data_parallel.embedding). Its weight starts normal."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__(vocab, hidden)
        declare(self, weight="normal")

    def forward(self, ids):
        return embedding(ids, self.weight)


class LMHead(nn.Linear):
    """The logits, or with labels the token-summed fp32 cross-entropy without materializing them; the loss too
    is a call of this module, for FSDP to gather its weight around. Its weight starts normal."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__(hidden, vocab, bias=False)
        declare(self, weight="normal")

    def forward(self, x, labels=None):
        if labels is None:
            return super().forward(x)
        return linear_cross_entropy(x.flatten(0, 1), self.weight, labels.flatten())


class CausalLM(nn.Module):
    """What the three families' top-level models share: the Hugging Face trunk (model.embed_tokens,
    model.layers, model.norm, lm_head), init, logits, loss and the checkpoint views; with the family's
    layers, a pith_engine.contract.MoeModel. A subclass passes in its own layers and final norm and writes
    layer_args (what its layers take after x)."""

    def __init__(self, cfg, make_layer, norm: nn.Module, held_layers=None, parallel: Parallel = Parallel()):
        """make_layer(n): decoder layer n. held_layers: the layer numbers this process builds (a pipeline rank's
        chunks; default all), the embedding with layer 0, the final norm and LM head with the last. parallel:
        with cp > 1 the model takes this rank's zigzag part of each sequence (its positions, `positions`)."""
        super().__init__()
        self.config, self.parallel = cfg, parallel
        held = range(cfg.num_hidden_layers) if held_layers is None else sorted(held_layers)
        last = cfg.num_hidden_layers - 1
        trunk = dict(embed_tokens=Embedding(cfg.vocab_size, cfg.hidden_size)) if 0 in held else {}
        trunk["layers"] = nn.ModuleDict({str(n): make_layer(n) for n in held})   # names as the files': layers.N.
        self.model = nn.ModuleDict(trunk | (dict(norm=norm) if last in held else {}))
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size) if last in held else None
        self.wgrad_pairs = None   # pith_engine.data_parallel.pair_expert_wgrads

    @torch.no_grad()
    def init_weights(self, seed: int):
        """Each parameter as its module declares (`declare`), drawn on the parameter's device from its own seed and
        full name (each expert of a stack from its own), so that every parallel layout starts from the same weights;
        a rank keeps only its part of each. Buffers (the load-balancing state) start at 0. For a model built on the
        meta device, call after to_empty."""
        def draw(key: str, shape, device):
            generator = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            return torch.randn(shape, generator=generator, device=device) * self.config.initializer_range

        for prefix, module in self.named_modules():
            for key, param in module.named_parameters(recurse=False):
                name, declared = f"{prefix}.{key}" if prefix else key, getattr(module, "declared", {}).get(key)
                if declared is None:
                    raise TypeError(f"parameter {name} of {type(module).__name__} declares no start; declare it where "
                                    "it is made (pith_apps.models.layers.declare)")
                if declared.rule in ("zeros", "ones"):
                    local_part(param).fill_(float(declared.rule == "ones"))
                    continue
                if declared.rule == "normal_per_expert":
                    full = torch.stack([draw(f"{name}.{module.first_expert + e}", param.shape[1:], param.device)
                                        for e in range(param.shape[0])])
                else:
                    full = draw(name, param.shape, param.device)
                    full = full if declared.rule == "normal" else declared.rule(full)
                local_part(param).copy_(this_ranks_part(full, param))
        for buffer in self.buffers():
            buffer.zero_()

    @property
    def layers(self) -> dict[int, nn.Module]:
        return {int(n): layer for n, layer in self.model.layers.items()}

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, input_ids, labels=None, docs=None, hidden=None, layers=None):
        """Logits [batch, seq, vocab]; with labels, the token-summed fp32 cross-entropy over labels != -100,
        without materializing the logits (the caller divides once by the token count). docs: the document index
        of each token ([batch, seq]): each token then attends to and counts positions within its own document
        only. A pipeline chunk: `layers` (their numbers; default all) on `hidden` (default the embedding of
        input_ids); the hidden states they output unless they end with the model's last layer. One entry point
        for every piece, so that mixed precision and FSDP, which hook it, wrap each."""
        x = self.model.embed_tokens(input_ids) if hidden is None else hidden
        layer_args = self.layer_args(self.positions(input_ids, docs), docs, x.dtype)
        numbers = list(self.layers) if layers is None else layers
        for n in numbers:
            x = self.model.layers[str(n)](x, *layer_args)
        if numbers[-1] != self.config.num_hidden_layers - 1:
            return x
        return self.lm_head(self.model.norm(x), labels)

    def positions(self, input_ids, docs):
        """Each token's rotary position: in its sequence ([seq]), or in its document ([batch, seq], docs); under
        context parallelism, of this rank's zigzag part of the sequence."""
        cp = self.parallel.cp
        if cp == 1:
            return token_positions(input_ids, docs)
        if docs is not None:
            raise LayoutError(f"--doc-mask is not supported with --cp={cp} (ring attention masks by position only); "
                              "drop one of them")
        return zigzag_positions(input_ids.shape[1], cp, self.parallel.coords["cp"], input_ids.device)

    def loss_sum(self, input_ids, labels, docs=None):
        return self(input_ids, labels, docs)

    def hf_views(self):
        """(Hugging Face tensor name, view of the parameter holding it): import copies into the views, export
        reads them. Each experts module says how its stacked weights appear in the files."""
        for prefix, module in self.named_modules():
            if isinstance(module, LocalExperts):
                yield from module.hf_views(prefix)
            else:
                yield from module.named_parameters(prefix, recurse=False)
