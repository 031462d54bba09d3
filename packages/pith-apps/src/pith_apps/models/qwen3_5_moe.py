"""Qwen3.5-MoE, the text model (Hugging Face model_type "qwen3_5_moe_text"; Qwen3.5-35B-A3B's language model and
its tiny relatives).

Parameter names mirror the Hugging Face checkpoint (model.layers.N.linear_attn.in_proj_qkv.weight, ...), except
that each layer's experts are stacked as Qwen3-MoE's are. Two kinds of layer, by config layer_types: most are
Gated DeltaNet linear attention (a causal depthwise convolution over q, k and v, the gated delta rule of
pith_ops.gated_delta, a norm gated by silu(z)); every few is full attention with a sigmoid output gate, q/k norms
and rotary embeddings on the first quarter of each head. Every layer's MLP is the same MoE: softmax router, top-k
renormalized, plus a shared expert scaled by sigmoid(shared_expert_gate(x)). The norms are zero-centered: they
scale by 1 + weight, and their weights start at 0. Under context parallelism the full-attention layers use ring
attention; the linear-attention layers run every chunk at once from a zero state and then correct each for the
state it starts from, found by a scan of all chunks' affine state maps (zigzag_affine_carries).

Each decoder layer is cut into the stages of docs/architecture.md: attention_stage (norm, token mixer, router),
expert_stage (grouped GEMM SwiGLU), aggregate_stage (the routed sum, the gated shared expert, the residual).
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pith_apps.config import config_from_dict, qwen3_5_layer_types, require, text_config
from pith_apps.models.layers import (CausalLM, Linear, MoeDecoderLayer, SwiGLUExperts, SwiGLUMLP, apply_rotary,
                                     causal_attention, declare, default_inv_freq, document_starts, rope_parameters,
                                     rotary_cos_sin)
from pith_engine.context_parallel import zigzag_affine_carries, zigzag_previous
from pith_engine.moe import LoadBalance, Routing
from pith_engine.parallel import Parallel
from pith_ops.gated_delta import gated_delta, gated_delta_from_unknown_state

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass
class Qwen3_5MoeConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    linear_conv_kernel_dim: int = 4
    layer_types: list = field(default_factory=list)
    full_attention_interval: int = 4
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> "Qwen3_5MoeConfig":
        """A text config, or a released model's (model_type qwen3_5_moe) whose text_config it is."""
        data = text_config(data)
        rope = rope_parameters(data)
        require(rope["rope_type"] == "default",
                f"config rope_type={rope['rope_type']!r} is not supported for qwen3_5_moe; valid: 'default'")
        data = {**data, **{key: rope[key] for key in ("rope_theta", "partial_rotary_factor") if key in rope}}
        cfg = config_from_dict(cls, data, "qwen3_5_moe_text")
        cfg.layer_types = qwen3_5_layer_types(vars(cfg))
        require(len(cfg.layer_types) == cfg.num_hidden_layers and set(cfg.layer_types) <= set(LAYER_KINDS),
                f"config layer_types={cfg.layer_types} must give one of {', '.join(LAYER_KINDS)} for each of the "
                f"{cfg.num_hidden_layers} layers")
        require(cfg.num_attention_heads % cfg.num_key_value_heads == 0
                and cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0,
                f"config heads: num_attention_heads={cfg.num_attention_heads} must be a multiple of num_key_value_heads="
                f"{cfg.num_key_value_heads} and linear_num_value_heads={cfg.linear_num_value_heads} of "
                f"linear_num_key_heads={cfg.linear_num_key_heads}")
        rotary = cfg.head_dim * cfg.partial_rotary_factor
        require(rotary == int(rotary) and int(rotary) % 2 == 0 and 0 < rotary <= cfg.head_dim,
                f"config head_dim={cfg.head_dim} x partial_rotary_factor={cfg.partial_rotary_factor} must be an even "
                "number of rotary dimensions, at most head_dim")
        require(cfg.num_experts_per_tok <= cfg.num_experts,
                f"config num_experts_per_tok={cfg.num_experts_per_tok} must be at most num_experts={cfg.num_experts}")
        require(not cfg.tie_word_embeddings and not cfg.attention_bias,
                "config tie_word_embeddings and attention_bias must be false for qwen3_5_moe")
        return cfg


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32 (or wider), cast back to the input dtype; the weight starts at 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        declare(self, weight="zeros")

    def forward(self, x):
        wide = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(wide)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight.to(wide))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """(weight * x / rms(x)) * silu(gate): the normalized x cast to the input dtype before the weight, the gate in
    fp32; per head of the delta rule's output."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        declare(self, weight="ones")

    def forward(self, x, gate):
        wide = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(wide)
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.to(wide))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig, parallel: Parallel):
        super().__init__()
        self.ring = parallel.group("cp")   # context parallelism's group, None without
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        channels = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        self.in_proj_qkv = Linear(cfg.hidden_size, channels, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, self.v_heads * self.v_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.conv1d = declare(nn.Conv1d(channels, channels, cfg.linear_conv_kernel_dim, groups=channels, bias=False),
                              weight="normal")
        self.taps = cfg.linear_conv_kernel_dim
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))   # the log of the decay rates A, spread over [1, 16]
        declare(self, dt_bias="ones", A_log=lambda draw: torch.linspace(1, 16, len(draw), device=draw.device).log())
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.v_heads * self.v_dim, cfg.hidden_size, bias=False)

    def forward(self, x, docs=None):
        """With docs ([batch, seq] document index of each token) each document starts from a zero state and its
        convolution sees only its own tokens."""
        if self.ring is not None and docs is None:   # (the app refuses --doc-mask with --cp)
            return self.zigzag_forward(x)
        q, k, v, g, beta = self.rule_inputs(x, self.in_proj_qkv(x).transpose(1, 2), docs=docs)
        starts = None if docs is None else document_starts(docs)   # the rule drops the state before these
        return self.output(gated_delta(q, k, v, g, beta, None, self.k_dim ** -0.5, starts)[0], x)

    def zigzag_forward(self, x):
        """Under context parallelism, x this rank's two zigzag chunks: the convolution reads the previous chunk's
        last inputs (zigzag_previous), and the delta rule runs each chunk at once, its output then corrected for the
        state the chunk starts from (zigzag_affine_carries)."""
        half = x.shape[1] // 2
        require(half >= self.taps - 1, f"under --cp each sequence chunk has {half} tokens, fewer than the "
                f"convolution's {self.taps - 1} previous inputs; use a --seq-len of at least 2 x cp x {self.taps - 1}")
        parts = x[:, :half], x[:, half:]
        inputs = [self.in_proj_qkv(part).transpose(1, 2) for part in parts]
        tails = zigzag_previous(tuple(i[..., half - self.taps + 1:] for i in inputs), self.ring)
        runs = [gated_delta_from_unknown_state(*self.rule_inputs(*part), self.k_dim ** -0.5)
                for part in zip(parts, inputs, tails)]
        starts = zigzag_affine_carries(tuple(final for _, final in runs), self.v_dim, self.ring)
        corrected = [(zeroed.to(start.dtype) + torch.einsum("bshk,bhkv->bshv", seen.to(start.dtype), start))
                     .to(zeroed.dtype) for ((zeroed, seen), _), start in zip(runs, starts)]
        return torch.cat([self.output(out, part) for out, part in zip(corrected, parts)], dim=1)

    def rule_inputs(self, x, inputs, tail=None, docs=None):
        """The delta rule's q, k, v (per head), log-decay g and write strength beta for x, given `inputs` (x's
        convolution inputs, [batch, channels, seq]) and `tail` (the inputs of the taps - 1 tokens before x; None:
        x starts the sequence)."""
        batch, seq, _ = x.shape
        tail = inputs.new_zeros(*inputs.shape[:2], self.taps - 1) if tail is None else tail
        mixed = torch.cat([tail, inputs], dim=-1)
        if docs is None:
            conv = F.conv1d(mixed, self.conv1d.weight, groups=mixed.shape[1])
        else:   # tap i reads the token taps - 1 - i back, only when it is of the same document
            doc = F.pad(docs, (self.taps - 1, 0), value=-1)   # the tail (zeros) belongs to no document
            conv = sum(self.conv1d.weight[:, :, i] * mixed[..., i:i + seq] * (doc[:, None, i:i + seq] == docs[:, None])
                       for i in range(self.taps))
        q, k, v = F.silu(conv).transpose(1, 2).split(
            [self.k_heads * self.k_dim, self.k_heads * self.k_dim, self.v_heads * self.v_dim], dim=-1)
        wide = torch.promote_types(x.dtype, torch.float32)   # the decay and write strength in fp32 (or wider)
        g = -self.A_log.to(wide).exp() * F.softplus(self.in_proj_a(x).to(wide) + self.dt_bias)
        heads = (t.view(batch, seq, -1, width) for t, width in zip((q, k, v), (self.k_dim, self.k_dim, self.v_dim)))
        return *heads, g, self.in_proj_b(x).to(wide).sigmoid()

    def output(self, out, x):
        """out_proj(the rule's output, normed per head and gated by silu(z))."""
        z = self.in_proj_z(x).view(*out.shape)
        return self.out_proj(self.norm(out, z).reshape(*x.shape[:2], -1))


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig, parallel: Parallel):
        super().__init__()
        self.ring = parallel.group("cp")   # context parallelism's group, None without
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim * 2, bias=False)   # each head's q, then gate
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, docs=None):
        batch, seq, _ = x.shape
        q, gate = self.q_proj(x).view(batch, seq, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = (torch.cat([apply_rotary(t[..., :self.rotary], cos, sin), t[..., self.rotary:]], dim=-1) for t in (q, k))
        out = causal_attention(q, k, v, self.head_dim ** -0.5, enable_gqa=True, docs=docs, ring=self.ring)
        out = out.transpose(1, 2).reshape(batch, seq, -1) * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.o_proj(out)


class Qwen3_5MoeSparseBlock(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig, parallel: Parallel):
        super().__init__()
        self.gate = declare(nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False), weight="normal")
        self.experts = SwiGLUExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, parallel)
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = declare(nn.Linear(cfg.hidden_size, 1, bias=False), weight="normal")


class Qwen3_5MoeDecoderLayer(MoeDecoderLayer):
    fullgraph = False   # on a GPU the delta rule is fla-core's, which dynamo skips: the compiled stage breaks around it

    def __init__(self, cfg: Qwen3_5MoeConfig, kind: str, parallel: Parallel, balance: str, micro_batches: int = 1):
        super().__init__()
        self.num_experts, self.top_k, self.kind = cfg.num_experts, cfg.num_experts_per_tok, kind
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, parallel)
        else:
            self.self_attn = GatedAttention(cfg, parallel)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3_5MoeSparseBlock(cfg, parallel)
        self.balance = LoadBalance(cfg.num_experts, balance, cfg.router_aux_loss_coef, cfg.num_experts,
                                   parallel.group("dp", "cp", "ep"), micro_batches=micro_batches,
                                   context_group=parallel.group("cp"))

    def attention_stage(self, x, cos, sin, docs=None):
        normed = self.input_layernorm(x)
        mixed = self.linear_attn(normed, docs) if self.kind == "linear_attention" else self.self_attn(normed, cos, sin, docs)
        hidden = x + mixed
        tokens = self.post_attention_layernorm(hidden).flatten(0, 1)
        probs = torch.softmax(self.mlp.gate(tokens).float(), dim=-1)
        expert_ids, weights = self.balance.select(probs, self.top_k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        hidden = self.balance.attach_loss(hidden, probs, expert_ids, x.shape[0])
        return hidden, tokens, Routing(expert_ids, weights.to(x.dtype))

    def aggregate_stage(self, hidden, tokens, routed):
        shared = torch.sigmoid(self.mlp.shared_expert_gate(tokens)) * self.mlp.shared_expert(tokens)
        return hidden + (routed + shared).view_as(hidden)


class Qwen3_5MoeForCausalLM(CausalLM):
    def __init__(self, cfg: Qwen3_5MoeConfig, parallel: Parallel = Parallel(), balance: str = "global_batch",
                 micro_batches: int = 1, held_layers=None):
        """micro_batches: per data rank per optimizer step, which the aux losses are averaged over. held_layers:
        the layer numbers this process builds (CausalLM)."""
        super().__init__(cfg, lambda n: Qwen3_5MoeDecoderLayer(cfg, cfg.layer_types[n], parallel, balance, micro_batches),
                         ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps), held_layers, parallel)

    def layer_args(self, positions, docs, dtype):
        rotary = int(self.config.head_dim * self.config.partial_rotary_factor)
        inv_freq = default_inv_freq(rotary, self.config.rope_theta, positions.device)
        return (*rotary_cos_sin(positions, inv_freq, dtype), docs)
