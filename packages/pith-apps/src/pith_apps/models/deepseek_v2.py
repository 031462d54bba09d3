"""DeepSeek-V2 (Hugging Face model_type "deepseek_v2"; DeepSeek-V2, DeepSeek-V2-Lite and tiny relatives).

Parameter names mirror the Hugging Face checkpoint (model.layers.N.self_attn.kv_b_proj.weight, ...), except
that each MoE layer's routed experts are stacked: mlp.experts.gate_up_proj [E, 2 * moe_intermediate, hidden]
(gate rows first, then up) and mlp.experts.down_proj [E, hidden, moe_intermediate].

Attention is MLA: keys and values come from one shared latent (kv_lora_rank wide) plus one rotary key for all
heads; queries optionally from a latent too (q_lora_rank). The first first_k_dense_replace layers end in a
dense SwiGLU MLP and run whole; the others are MoE layers cut into the stages of docs/architecture.md
(attention_stage, expert_stage, aggregate_stage) that pith_engine.moe.run_moe_layer sequences.

Routing follows DeepSeek's own modeling code, which transformers simplifies in two places: with
norm_topk_prob the top-k weights are renormalized INSTEAD of multiplied by routed_scaling_factor
(transformers ignores norm_topk_prob), and the sequence-level balance loss (aux_loss_alpha, seq_aux) that
transformers does not implement is attached to the router's backward.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pith_apps.config import config_from_dict, require
from pith_apps.models.layers import (CausalLM, Linear, MoeDecoderLayer, RMSNorm, causal_attention, declare,
                                     SwiGLUExperts, SwiGLUMLP, apply_rotary, default_inv_freq, rope_parameters, rotary_cos_sin,
                                     yarn_inv_freq, yarn_mscale)
from pith_engine.context_parallel import ring_attention
from pith_engine.moe import LoadBalance, Routing
from pith_engine.parallel import Parallel

LATENT_NORM_EPS = 1e-6  # DeepSeek builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps
# config.json values this file implements only one way of (the first is the default)
FIXED_CHOICES = {"topk_method": ("greedy", "group_limited_greedy"), "scoring_func": ("softmax",),
                 "hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "moe_layer_freq": (1,)}
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate")


@dataclass
class DeepseekV2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int        # the dense layers' SwiGLU width
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    q_lora_rank: int | None = None   # None: plain q_proj
    first_k_dense_replace: int = 0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_type: str = "default"    # or "yarn", with the values below from rope_scaling / rope_parameters
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @classmethod
    def from_dict(cls, data: dict) -> "DeepseekV2Config":
        # null means unset (transformers writes q_lora_rank, n_group, topk_group as null). Published files keep
        # rope_theta and rope_scaling at the top level, transformers v5 writes one rope_parameters dict.
        rope = rope_parameters(data)
        require(rope["rope_type"] in ("default", "yarn"),
                f"config rope_type={rope['rope_type']!r} is not supported for deepseek_v2; valid: 'default', 'yarn'")
        if rope["rope_type"] == "yarn":
            missing = [key for key in ("factor", "original_max_position_embeddings") if key not in rope]
            require(not missing, f"config rope_scaling (yarn) is missing {', '.join(missing)}")
            require("attention_factor" not in rope, "config rope attention_factor is not supported; valid: leave it "
                    "out (the cos/sin scale follows from factor, mscale and mscale_all_dim)")
        for key, valid in FIXED_CHOICES.items():
            require(data.get(key) in (None, *valid), f"config {key}={data.get(key)!r} is not supported for "
                    f"deepseek_v2; valid: {', '.join(map(repr, valid))}")
        keys = ("rope_theta", "rope_type") + (YARN_KEYS if rope["rope_type"] == "yarn" else ())
        cfg = config_from_dict(cls, data | {key: rope[key] for key in keys if key in rope}, "deepseek_v2")
        cfg.check()
        return cfg

    def check(self):
        cfg = self
        require(cfg.first_k_dense_replace <= cfg.num_hidden_layers, f"config first_k_dense_replace="
                f"{cfg.first_k_dense_replace} must be at most num_hidden_layers={cfg.num_hidden_layers}")
        require(cfg.num_experts_per_tok <= cfg.n_routed_experts, f"config num_experts_per_tok="
                f"{cfg.num_experts_per_tok} must be at most n_routed_experts={cfg.n_routed_experts}")
        require(cfg.qk_rope_head_dim % 2 == 0,
                f"config qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (rotary pairs)")
        require(cfg.rope_theta > 0 and cfg.rms_norm_eps > 0 and cfg.factor > 0, f"config rope_theta={cfg.rope_theta}, "
                f"rms_norm_eps={cfg.rms_norm_eps} and factor={cfg.factor} must be > 0")
        require(not cfg.tie_word_embeddings, "config tie_word_embeddings=true is not supported; valid: false")
        if cfg.topk_method == "group_limited_greedy":
            group = cfg.n_routed_experts // cfg.n_group
            require(group * cfg.n_group == cfg.n_routed_experts and cfg.topk_group <= cfg.n_group,
                    f"config n_group={cfg.n_group} must divide n_routed_experts={cfg.n_routed_experts} "
                    f"and topk_group={cfg.topk_group} be at most n_group")
            require(cfg.topk_group * group >= cfg.num_experts_per_tok,
                    f"config topk_group={cfg.topk_group} groups of {group} experts hold fewer than "
                    f"num_experts_per_tok={cfg.num_experts_per_tok}")


def rotary_tables(cfg: DeepseekV2Config, positions: torch.Tensor, dtype):
    """cos, sin [seq, qk_rope_head_dim] (rotary_cos_sin's shapes). YaRN scales them by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), with DeepSeek's defaults mscale 1 and mscale_all_dim 0 (transformers differs
    only when just one is set)."""
    if cfg.rope_type == "default":
        return rotary_cos_sin(positions, default_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, positions.device),
                              dtype)
    inv_freq = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.factor, cfg.original_max_position_embeddings,
                             cfg.beta_fast, cfg.beta_slow, cfg.truncate, positions.device)
    scale = yarn_mscale(cfg.factor, cfg.mscale) / yarn_mscale(cfg.factor, cfg.mscale_all_dim)
    return rotary_cos_sin(positions, inv_freq, dtype, scale)


def apply_rotary_pairs(x, cos, sin):
    """DeepSeek's rotary dims come as adjacent pairs (2i, 2i+1); regroup them evens-then-odds for the rotate-half
    layout. Queries and keys are regrouped alike, so their dot products equal the pairwise rotation's."""
    return apply_rotary(x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2), cos, sin)


class DeepseekV2Attention(nn.Module):
    def __init__(self, cfg: DeepseekV2Config, parallel: Parallel):
        super().__init__()
        self.ring = parallel.group("cp")   # context parallelism's group, None without
        self.heads, self.kv_lora_rank = cfg.num_attention_heads, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_out, self.q_lora = self.heads * (self.nope_dim + self.rope_dim), bool(cfg.q_lora_rank)
        if self.q_lora:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(self.heads * self.v_dim, cfg.hidden_size, bias=False)
        # YaRN sharpens the softmax by mscale(factor, mscale_all_dim)^2 (1 without YaRN: factor 1)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5 * yarn_mscale(cfg.factor, cfg.mscale_all_dim) ** 2

    def forward(self, x, cos, sin, docs=None):
        batch, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(batch, seq, self.heads, -1).transpose(1, 2).split([self.nope_dim, self.rope_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent, k_rope = self.kv_a_layernorm(latent), apply_rotary_pairs(k_rope.unsqueeze(1), cos, sin)
        query = torch.cat([q_nope, apply_rotary_pairs(q_rope, cos, sin)], -1)
        if self.ring is not None:   # the latent and the shared rope key travel, not each head's key and value
            weight = self.kv_b_proj.weight   # this forward's, for the ring's backward, which expands again
            out = ring_attention(query, (latent, k_rope), self.ring, self.scale,
                                 expand=lambda latent, k_rope: self.keys_and_values(latent, k_rope, weight))[0]
        else:
            out = causal_attention(query, *self.keys_and_values(latent, k_rope), self.scale, docs=docs)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def keys_and_values(self, latent, k_rope, weight=None):
        """Each head's key (its nope part from the normed latent, the rope part shared) and value; weight: kv_b_proj's
        to compute with where not the one it holds (after the forward ComputeCasts has put the fp32 master back)."""
        batch, seq, _ = latent.shape
        kv = (self.kv_b_proj(latent) if weight is None
              else torch.func.functional_call(self.kv_b_proj, {"weight": weight}, (latent,)))
        kv = kv.view(batch, seq, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], -1)
        return torch.cat([k_nope, k_rope.expand(-1, self.heads, -1, -1)], -1), v   # one rope key for all heads


class DeepseekV2Moe(nn.Module):
    def __init__(self, cfg: DeepseekV2Config, parallel: Parallel):
        super().__init__()
        self.gate = declare(nn.Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False), weight="normal")
        self.experts = SwiGLUExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, parallel)
        self.shared_experts = SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)


class DeepseekV2DecoderLayer(MoeDecoderLayer):
    """A dense layer (the first first_k_dense_replace) runs whole through forward; an MoE layer runs as stages
    through run_moe_layer."""

    def __init__(self, cfg: DeepseekV2Config, moe: bool, parallel: Parallel, balance: str | None, micro_batches: int = 1):
        super().__init__()
        self.is_moe, self.num_experts, self.top_k = moe, cfg.n_routed_experts, cfg.num_experts_per_tok
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DeepseekV2Attention(cfg, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekV2Moe(cfg, parallel) if moe else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        if moe:   # DeepSeek's expert balance loss is the switch loss divided by top_k
            self.balance = LoadBalance(cfg.n_routed_experts, balance or ("sequence" if cfg.seq_aux else "global_batch"),
                                       cfg.aux_loss_alpha, cfg.n_routed_experts / cfg.num_experts_per_tok,
                                       parallel.group("dp", "cp", "ep"), micro_batches=micro_batches,
                                       context_group=parallel.group("cp"))

    def forward(self, x, cos, sin, docs=None):
        if self.is_moe:
            return super().forward(x, cos, sin, docs)
        hidden = x + self.self_attn(self.input_layernorm(x), cos, sin, docs)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def attention_stage(self, x, cos, sin, docs=None):
        hidden = x + self.self_attn(self.input_layernorm(x), cos, sin, docs)
        tokens = self.post_attention_layernorm(hidden).flatten(0, 1)
        scores = torch.softmax(F.linear(tokens.float(), self.mlp.gate.weight.float()), dim=-1)  # router in fp32
        expert_ids, weights = self.route(scores)
        hidden = self.balance.attach_loss(hidden, scores, expert_ids, x.shape[0])
        return hidden, tokens, Routing(expert_ids, weights.to(x.dtype))

    def route(self, scores):
        """Top-k experts per token; group-limited: only among the topk_group groups whose best expert scores highest."""
        cfg, allowed = self.cfg, None
        if cfg.topk_method == "group_limited_greedy":
            groups = scores.unflatten(-1, (cfg.n_group, -1))
            best = groups.amax(-1).topk(cfg.topk_group, dim=-1).indices
            keep = torch.zeros(groups.shape[:-1], dtype=torch.bool, device=scores.device).scatter_(-1, best, True)
            allowed = keep.unsqueeze(-1).expand_as(groups).flatten(-2)
        expert_ids, weights = self.balance.select(scores, self.top_k, allowed)
        if cfg.norm_topk_prob and self.top_k > 1:  # DeepSeek-V2 renormalizes instead of scaling
            return expert_ids, weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * cfg.routed_scaling_factor

    def aggregate_stage(self, hidden, tokens, routed):
        return hidden + (routed + self.mlp.shared_experts(tokens)).view_as(hidden)


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, cfg: DeepseekV2Config, parallel: Parallel = Parallel(), balance: str | None = None,
                 micro_batches: int = 1, held_layers=None):
        """balance None: DeepSeek's own choice, a sequence-level loss when cfg.seq_aux, else global_batch.
        micro_batches: per data rank per optimizer step, which the aux losses are averaged over. held_layers:
        the layer numbers this process builds (CausalLM)."""
        super().__init__(cfg, lambda n: DeepseekV2DecoderLayer(cfg, n >= cfg.first_k_dense_replace, parallel, balance,
                                                               micro_batches),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), held_layers, parallel)

    def layer_args(self, positions, docs, dtype):
        return (*rotary_tables(self.config, positions, dtype), docs)
