"""Qwen3-MoE (Hugging Face model_type "qwen3_moe"; Qwen3-30B-A3B and its tiny relatives).

Parameter names mirror the Hugging Face checkpoint (model.layers.N.self_attn.q_proj.weight, ...), except
that each layer's experts are stacked: mlp.experts.gate_up_proj [E, 2 * moe_intermediate, hidden] (gate
rows first, then up) and mlp.experts.down_proj [E, hidden, moe_intermediate].

Each decoder layer is cut into the stages of docs/architecture.md: attention_stage (norms, attention,
router), expert_stage (grouped GEMM SwiGLU), aggregate_stage (weighted sum and residual);
pith_engine.moe runs dispatch and combine between them.
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from pith_apps.config import config_from_dict, require
from pith_apps.models.layers import (CausalLM, Linear, MoeDecoderLayer, RMSNorm, causal_attention, declare,
                                     SwiGLUExperts, apply_rotary, default_inv_freq, rope_parameters, rotary_cos_sin)
from pith_engine.moe import LoadBalance, Routing
from pith_engine.parallel import Parallel


@dataclass
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> "Qwen3MoeConfig":
        # published files say num_experts and rope_theta; transformers v5 num_local_experts and rope_parameters
        rope = rope_parameters(data)
        require(rope["rope_type"] == "default",
                f"config rope_type={rope['rope_type']!r} is not supported for qwen3_moe; valid: 'default'")
        data = {**data, **({"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else {})}
        if "num_local_experts" in data:
            data.setdefault("num_experts", data["num_local_experts"])
        cfg = config_from_dict(cls, data, "qwen3_moe")
        require(cfg.num_attention_heads % cfg.num_key_value_heads == 0,
                f"config num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}")
        require(cfg.num_experts_per_tok <= cfg.num_experts,
                f"config num_experts_per_tok={cfg.num_experts_per_tok} must be at most num_experts={cfg.num_experts}")
        require(cfg.head_dim % 2 == 0, f"config head_dim={cfg.head_dim} must be even (rotary embedding)")
        require(cfg.rope_theta > 0 and cfg.rms_norm_eps > 0,
                f"config rope_theta={cfg.rope_theta} and rms_norm_eps={cfg.rms_norm_eps} must be > 0")
        require(not cfg.tie_word_embeddings, "config tie_word_embeddings=true is not supported; valid: false")
        require(cfg.decoder_sparse_step == 1 and not cfg.mlp_only_layers,
                f"config decoder_sparse_step={cfg.decoder_sparse_step} / mlp_only_layers={cfg.mlp_only_layers} "
                "is not supported: every layer must be MoE (decoder_sparse_step 1, mlp_only_layers [])")
        return cfg


class Qwen3MoeAttention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, parallel: Parallel):
        super().__init__()
        self.ring = parallel.group("cp")   # context parallelism's group, None without
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, docs=None):
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = causal_attention(q, k, v, self.head_dim ** -0.5, enable_gqa=True, docs=docs, ring=self.ring)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, parallel: Parallel):
        super().__init__()
        self.gate = declare(nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False), weight="normal")
        self.experts = SwiGLUExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, parallel)


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    def __init__(self, cfg: Qwen3MoeConfig, parallel: Parallel, balance: str, micro_batches: int = 1):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3MoeAttention(cfg, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MoeSparseBlock(cfg, parallel)
        self.balance = LoadBalance(cfg.num_experts, balance, cfg.router_aux_loss_coef, cfg.num_experts,
                                   parallel.group("dp", "cp", "ep"), micro_batches=micro_batches,
                                   context_group=parallel.group("cp"))

    def attention_stage(self, x, cos, sin, docs=None):
        hidden = x + self.self_attn(self.input_layernorm(x), cos, sin, docs)
        tokens = self.post_attention_layernorm(hidden).flatten(0, 1)
        probs = torch.softmax(self.mlp.gate(tokens).float(), dim=-1)
        expert_ids, weights = self.balance.select(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        hidden = self.balance.attach_loss(hidden, probs, expert_ids, x.shape[0])
        return hidden, tokens, Routing(expert_ids, weights.to(x.dtype))


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: Qwen3MoeConfig, parallel: Parallel = Parallel(), balance: str = "global_batch",
                 micro_batches: int = 1, held_layers=None):
        """micro_batches: per data rank per optimizer step, which the aux losses are averaged over. held_layers:
        the layer numbers this process builds (CausalLM)."""
        super().__init__(cfg, lambda n: Qwen3MoeDecoderLayer(cfg, parallel, balance, micro_batches),
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), held_layers, parallel)

    def layer_args(self, positions, docs, dtype):
        inv_freq = default_inv_freq(self.config.head_dim, self.config.rope_theta, positions.device)
        return (*rotary_cos_sin(positions, inv_freq, dtype), docs)
