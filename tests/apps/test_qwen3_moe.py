"""Qwen3-MoE against a hand-written reference that shares no code with the model: explicit attention
with a causal mask, and a per-token loop over the chosen experts."""
import math

import pytest
import torch

from conftest import relative_error
from pith_apps.config import ConfigError
from pith_apps.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from pith_engine.moe import LoadBalance

TINY = dict(model_type="qwen3_moe", vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
            rope_theta=10000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.01)


def rms_norm(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    """x [seq, heads, dim]: rotate pairs (i, i + dim/2) by position * theta^(-2i/dim)."""
    seq, _, dim = x.shape
    half = dim // 2
    freq = torch.tensor([theta ** (-2 * i / dim) for i in range(half)])
    angle = torch.arange(seq)[:, None, None] * freq
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1)


def reference_logits(params, cfg, ids):
    """ids [seq] (one sequence) -> logits [seq, vocab]."""
    p = lambda name: params[name]
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    seq = ids.shape[0]
    x = p("model.embed_tokens.weight")[ids]
    for n in range(cfg.num_hidden_layers):
        pre = f"model.layers.{n}."
        h = rms_norm(x, p(pre + "input_layernorm.weight"), cfg.rms_norm_eps)
        q = (h @ p(pre + "self_attn.q_proj.weight").T).view(seq, heads, dim)
        k = (h @ p(pre + "self_attn.k_proj.weight").T).view(seq, kv_heads, dim)
        v = (h @ p(pre + "self_attn.v_proj.weight").T).view(seq, kv_heads, dim)
        q = rope(rms_norm(q, p(pre + "self_attn.q_norm.weight"), cfg.rms_norm_eps), cfg.rope_theta)
        k = rope(rms_norm(k, p(pre + "self_attn.k_norm.weight"), cfg.rms_norm_eps), cfg.rope_theta)
        out = torch.zeros(seq, heads, dim)
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(dim)
            scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
            out[:, head] = torch.softmax(scores, -1) @ v[:, kv]
        x = x + out.reshape(seq, -1) @ p(pre + "self_attn.o_proj.weight").T
        h = rms_norm(x, p(pre + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        probs = torch.softmax(h @ p(pre + "mlp.gate.weight").T, -1)
        gate_up, down = p(pre + "mlp.experts.gate_up_proj"), p(pre + "mlp.experts.down_proj")
        moe = torch.zeros_like(x)
        for t in range(seq):
            top = torch.topk(probs[t], cfg.num_experts_per_tok)
            for weight, e in zip(top.values / top.values.sum(), top.indices.tolist()):
                gate, up = (gate_up[e] @ h[t]).chunk(2)
                moe[t] += weight * (down[e] @ (gate * torch.sigmoid(gate) * up))
        x = x + moe
    return rms_norm(x, p("model.norm.weight"), cfg.rms_norm_eps) @ p("lm_head.weight").T


def tiny_model(seed=0, **overrides):
    cfg = Qwen3MoeConfig.from_dict({**TINY, **overrides})
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed)
    torch.manual_seed(seed)
    with torch.no_grad():  # random norm weights, so that a norm applied in the wrong place shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.mul_(10)  # std 0.2: routing and attention far from uniform
    return cfg, model


def test_forward_matches_hand_written_reference():
    cfg, model = tiny_model()
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    params = dict(model.named_parameters())
    for b in range(ids.shape[0]):
        # float32 throughout; only summation order differs
        assert relative_error(logits[b].detach(), reference_logits(params, cfg, ids[b]).detach()) < 1e-5


def test_aux_loss_gradient_reaches_the_router(monkeypatch):
    """Gradient of mean CE with the aux loss attached = gradient of (mean CE + coef * sum of per-layer aux)."""
    cfg, model = tiny_model(router_aux_loss_coef=0.5)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    (model.loss_sum(ids, ids) / ids.numel()).backward()
    attached = model.layers[0].mlp.gate.weight.grad.clone()

    cfg0, model0 = tiny_model(router_aux_loss_coef=0.0)
    aux = []

    def record(balance, hidden, probs, expert_ids, sequences):   # the switch loss, written out by hand
        counts = torch.stack([(expert_ids == e).sum() for e in range(cfg.num_experts)]).float()
        aux.append(cfg.num_experts * (counts / probs.shape[0] * probs.mean(0)).sum())
        return hidden
    monkeypatch.setattr(LoadBalance, "attach_loss", record)
    ce = model0.loss_sum(ids, ids) / ids.numel()
    (ce + 0.5 * sum(aux)).backward()
    assert relative_error(attached, model0.layers[0].mlp.gate.weight.grad) < 1e-6
    assert aux[0].item() > 0


@pytest.mark.parametrize("change,message", [
    (dict(num_key_value_heads=3), "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    (dict(num_experts_per_tok=7), "num_experts_per_tok=7 must be at most num_experts=6"),
    (dict(hidden_size=0), "hidden_size=0 must be a positive integer"),
    (dict(rope_theta="big"), "rope_theta='big' must be of type float"),
    (dict(model_type="llama"), "model_type='llama' does not match"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers=\\[0\\] is not supported"),
])
def test_bad_config_names_the_value(change, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3MoeConfig.from_dict({**TINY, **change})


def test_missing_config_value_is_named():
    data = dict(TINY)
    del data["num_experts"]
    with pytest.raises(ConfigError, match="missing required value 'num_experts'"):
        Qwen3MoeConfig.from_dict(data)
