"""GPT-OSS (Hugging Face model_type "gpt_oss"; gpt-oss-20b and its tiny relatives).

Parameter names are the Hugging Face checkpoint's (model.layers.N.self_attn.sinks, mlp.router.bias,
mlp.experts.gate_up_proj, ...). Expert weights are kept in the nn.Linear layout that grouped_linear
reads, mlp.experts.gate_up_proj [E, 2 * intermediate, hidden] (rows interleaved gate, up, gate, up, as
in the file) and mlp.experts.down_proj [E, hidden, intermediate]; the files hold them transposed
([E, in, out]), which hf_views() exposes as transposed views.

Each decoder layer is cut into the stages of docs/architecture.md: attention_stage (norms, attention
with sinks, router), expert_stage (grouped GEMM clamped SwiGLU with per-expert biases), aggregate_stage
(weighted sum and residual); pith_engine.moe runs dispatch and combine between them.
"""
import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from pith_apps.config import config_from_dict, require
from pith_apps.models.layers import (CausalLM, Linear, MoeDecoderLayer, LocalExperts, RMSNorm, apply_rotary, declare,
                                     rope_parameters, rotary_cos_sin, visible, yarn_inv_freq, yarn_mscale)
from pith_engine.context_parallel import ring_attention
from pith_engine.moe import LoadBalance, Routing
from pith_engine.parallel import Parallel
from pith_ops.grouped_gemm import grouped_bias_add, grouped_linear
from pith_ops.swiglu import clamped_swiglu

LAYER_TYPES = ("sliding_attention", "full_attention")
# what transformers' GptOssConfig uses when a config.json names no rope settings at all
DEFAULT_YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)


@dataclass
class GptOssConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int = 128
    layer_types: list = field(default_factory=list)
    rope_theta: float = 150000.0
    # YaRN, from the rope_scaling / rope_parameters dict of config.json
    rope_factor: float = 32.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-5
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    attention_bias: bool = True
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> "GptOssConfig":
        # published files say rope_scaling + rope_theta and may carry quantization_config (MXFP4 experts);
        # transformers v5 writes one rope_parameters dict
        has_rope = data.get("rope_scaling") or data.get("rope_parameters")
        rope = rope_parameters(data if has_rope else {**data, "rope_parameters": DEFAULT_YARN})
        require(rope["rope_type"] == "yarn",
                f"config rope_type={rope['rope_type']!r} is not supported for gpt_oss; valid: 'yarn'")
        quant = (data.get("quantization_config") or {}).get("quant_method", "mxfp4")
        require(quant == "mxfp4", f"config quantization_config.quant_method={quant!r} is not supported; valid: 'mxfp4'")
        data = {**data, **yarn_fields(rope)}
        if "num_experts" in data:
            data.setdefault("num_local_experts", data["num_experts"])
        cfg = config_from_dict(cls, data, "gpt_oss")
        if "layer_types" not in data:  # transformers' default: even layers sliding, odd layers full
            cfg.layer_types = [LAYER_TYPES[i % 2] for i in range(cfg.num_hidden_layers)]
        require(len(cfg.layer_types) == cfg.num_hidden_layers and all(t in LAYER_TYPES for t in cfg.layer_types),
                f"config layer_types={cfg.layer_types} must have num_hidden_layers={cfg.num_hidden_layers} "
                f"entries, each one of {', '.join(map(repr, LAYER_TYPES))}")
        require(cfg.num_attention_heads % cfg.num_key_value_heads == 0,
                f"config num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}")
        require(cfg.num_experts_per_tok <= cfg.num_local_experts,
                f"config num_experts_per_tok={cfg.num_experts_per_tok} must be at most "
                f"num_local_experts={cfg.num_local_experts}")
        require(cfg.head_dim % 2 == 0, f"config head_dim={cfg.head_dim} must be even (rotary embedding)")
        require(cfg.rope_theta > 0 and cfg.rope_factor > 0 and cfg.rms_norm_eps > 0,
                f"config rope_theta={cfg.rope_theta}, rope factor={cfg.rope_factor} and "
                f"rms_norm_eps={cfg.rms_norm_eps} must be > 0")
        require(cfg.attention_bias, "config attention_bias=false is not supported for gpt_oss; valid: true")
        require(not cfg.tie_word_embeddings, "config tie_word_embeddings=true is not supported; valid: false")
        return cfg


def yarn_fields(rope: dict) -> dict:
    """Our flat config fields from a YaRN rope dict, with transformers' defaults and its attention factor:
    attention_factor if given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) if both are
    given, else 0.1 * ln(factor) + 1."""
    missing = [key for key in ("factor", "original_max_position_embeddings") if key not in rope]
    require(not missing, f"config rope settings {rope} are missing {missing} (YaRN)")
    factor, mscale, mscale_all_dim = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor") or (
        yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
        else yarn_mscale(factor))
    fields = dict(rope_factor=factor, rope_original_max_position=rope["original_max_position_embeddings"],
                  rope_beta_fast=rope.get("beta_fast") or 32.0, rope_beta_slow=rope.get("beta_slow") or 1.0,
                  rope_truncate=rope.get("truncate", True), rope_attention_factor=attention_factor)
    return fields | ({"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else {})


def attention_with_sinks(q, k, v, sinks, window: int | None, scale: float, docs=None, ring=None):
    """Causal attention whose softmax has one extra column per head, the learned sink logit, dropped before
    multiplying V (so a row's weights sum to < 1). window: token i sees i - window + 1 .. i; docs ([batch, seq]
    document index of each token): only tokens of its own document.
    q [batch, heads, seq, dim], k and v [batch, kv_heads, seq, dim] -> [batch, heads, seq, dim].
    On CUDA: compiled flex_attention (no [seq, seq] scores in memory) and the sink as a rescale by the
    log-sum-exp; elsewhere (flex_attention has no CPU backward) the materialized reference. ring: the
    context-parallel group (pith_engine.context_parallel.ring_attention, then the same rescale by its lse)."""
    if ring is not None:
        out, lse = ring_attention(q, (k, v), ring, scale, window)
        return sink_rescale(out, lse, sinks)
    if q.is_cuda and docs is None:
        return flex_attention_with_sinks(q, k, v, sinks, window, scale)
    return materialized_attention_with_sinks(q, k, v, sinks, window, scale, docs)


def materialized_attention_with_sinks(q, k, v, sinks, window: int | None, scale: float, docs=None):
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    q = q.view(batch, kv_heads, heads // kv_heads, seq, dim)  # query head h reads kv head h // group
    scores = (q @ k.unsqueeze(2).transpose(-2, -1)).float() * scale
    seen = visible(seq, q.device, docs, window)
    scores = scores.masked_fill(~(seen if docs is None else seen[:, :, None]), float("-inf"))
    sink = sinks.float().view(1, kv_heads, -1, 1, 1).expand(batch, -1, -1, seq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v.unsqueeze(2)).flatten(1, 2)


@functools.cache
def compiled_flex_attention():
    """flex_attention is only fast compiled. Compiled on first use, not at import: merely calling
    torch.compile imports dynamo and inductor, seconds that every command would pay."""
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def window_block_mask(seq: int, window: int | None, device: str):
    def visible(batch, head, q_index, kv_index):
        causal = q_index >= kv_index
        return causal & (q_index - kv_index < window) if window else causal
    return create_block_mask(visible, None, None, seq, seq, device=device)


def flex_attention_with_sinks(q, k, v, sinks, window: int | None, scale: float, attend=None):
    """A softmax with one more column s: out * Z / (Z + e^s) = out * sigmoid(lse - s), lse = log Z.
    attend: the flex_attention to call (by default compiled, or as is inside a compiled stage, whose graph
    then compiles it; tests pass the eager one on CPU)."""
    attend = attend or (flex_attention if torch.compiler.is_compiling() else compiled_flex_attention())
    out, aux = attend(q, k, v, block_mask=window_block_mask(q.shape[2], window, str(q.device)),
                      scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return sink_rescale(out, aux.lse, sinks)


def sink_rescale(out, lse, sinks):
    """Attention out [batch, heads, seq, dim] with its log-sum-exp lse, as if each row's softmax had had the extra
    sink column: out * sigmoid(lse - sink)."""
    return out * torch.sigmoid(lse - sinks.float()[None, :, None]).unsqueeze(-1).to(out.dtype)


class GptOssAttention(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_type: str, parallel: Parallel):
        super().__init__()
        self.ring = parallel.group("cp")   # context parallelism's group, None without
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else None
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(self.heads))
        declare(self, sinks="normal")

    def forward(self, x, cos, sin, docs=None):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention_with_sinks(q, k, v, self.sinks, self.window, self.head_dim ** -0.5, docs, self.ring)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GptOssExperts(LocalExperts):
    """down(clamped_swiglu(gate_up(x) + b1)) + b2 per expert, stacked for grouped GEMMs. The biases are
    inside the expert, so the routing weight scales them too."""
    gate_up_rows = "whole"   # as the files hold it: gate and up in one tensor (Muon orthogonalizes it whole)

    def __init__(self, cfg: GptOssConfig, parallel: Parallel):
        super().__init__(cfg.num_local_experts, parallel)
        experts, hidden, inter = self.local_experts, cfg.hidden_size, cfg.intermediate_size
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))
        declare(self, gate_up_proj="normal_per_expert", down_proj="normal_per_expert", gate_up_proj_bias="zeros",
                down_proj_bias="zeros")

    def forward(self, x, tokens_per_expert):
        gate_up = grouped_linear(x, self.gate_up_proj, tokens_per_expert, self.wgrad_queue, self.wgrad_pairs,
                                 fp8=self.fp8)
        hidden = clamped_swiglu(grouped_bias_add(gate_up, self.gate_up_proj_bias, tokens_per_expert), self.alpha,
                                self.limit)
        down = grouped_linear(hidden, self.down_proj, tokens_per_expert, self.wgrad_queue, self.wgrad_pairs, fp8=self.fp8)
        return grouped_bias_add(down, self.down_proj_bias, tokens_per_expert)

    def hf_views(self, prefix: str):
        """The files hold all experts' weights stacked as [E, in, out] (gate/up still interleaved): transposed
        views, each with the rows of the file's expert dimension that this rank holds."""
        rows = slice(self.first_expert, self.first_expert + self.local_experts)
        yield f"{prefix}.gate_up_proj", self.gate_up_proj.transpose(1, 2), rows
        yield f"{prefix}.gate_up_proj_bias", self.gate_up_proj_bias, rows
        yield f"{prefix}.down_proj", self.down_proj.transpose(1, 2), rows
        yield f"{prefix}.down_proj_bias", self.down_proj_bias, rows


class GptOssSparseBlock(nn.Module):
    def __init__(self, cfg: GptOssConfig, parallel: Parallel):
        super().__init__()
        self.router = declare(nn.Linear(cfg.hidden_size, cfg.num_local_experts), weight="normal", bias="normal")
        self.experts = GptOssExperts(cfg, parallel)


class GptOssDecoderLayer(MoeDecoderLayer):
    def __init__(self, cfg: GptOssConfig, layer_type: str, parallel: Parallel, balance: str, micro_batches: int = 1):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale_in_fp32=True)
        self.self_attn = GptOssAttention(cfg, layer_type, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale_in_fp32=True)
        self.mlp = GptOssSparseBlock(cfg, parallel)
        self.balance = LoadBalance(cfg.num_local_experts, balance, cfg.router_aux_loss_coef, cfg.num_local_experts,
                                   parallel.group("dp", "cp", "ep"), micro_batches=micro_batches,
                                   context_group=parallel.group("cp"))

    def attention_stage(self, x, cos, sin, docs=None):
        hidden = x + self.self_attn(self.input_layernorm(x), cos, sin, docs)
        tokens = self.post_attention_layernorm(hidden).flatten(0, 1)
        logits = self.mlp.router(tokens).float()
        expert_ids, top_logits = self.balance.select(logits, self.top_k)  # top-k of raw logits, softmax over the k
        weights = torch.softmax(top_logits, dim=-1)
        hidden = self.balance.attach_loss(hidden, torch.softmax(logits, dim=-1), expert_ids, x.shape[0])
        return hidden, tokens, Routing(expert_ids, weights.to(x.dtype))


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: GptOssConfig, parallel: Parallel = Parallel(), balance: str = "global_batch",
                 micro_batches: int = 1, held_layers=None):
        """micro_batches: per data rank per optimizer step, which the aux losses are averaged over. held_layers:
        the layer numbers this process builds (CausalLM)."""
        super().__init__(cfg, lambda n: GptOssDecoderLayer(cfg, cfg.layer_types[n], parallel, balance, micro_batches),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, scale_in_fp32=True), held_layers, parallel)

    def layer_args(self, positions, docs, dtype):
        cfg = self.config
        inv_freq = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_position,
                                 cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_truncate, positions.device)
        return (*rotary_cos_sin(positions, inv_freq, dtype, scale=cfg.rope_attention_factor), docs)
