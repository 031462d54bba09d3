"""DeepSeek-V2 against transformers' modeling_deepseek_v2 on tiny random configs saved with save_pretrained:
logits, loss and every parameter's gradient, for each branch (query latent or not, dense first layers, greedy
and group-limited routing, routed_scaling_factor, YaRN and plain rope), and export / re-import.

transformers implements neither DeepSeek's sequence-level balance loss nor norm_topk_prob, so those are
checked against the formulas written out here, following DeepSeek's own modeling code."""
import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from conftest import relative_error
from hf_compare import check_export_round_trip, compare_forward_and_backward, load_ours, randomize, save_tiny_hf_model, shifted_labels
from pith_apps.config import ConfigError
from pith_apps.models.deepseek_v2 import DeepseekV2Config, DeepseekV2DecoderLayer, DeepseekV2ForCausalLM
from pith_engine.parallel import Parallel

PRESETS = Path(__file__).parents[2] / "packages/pith-apps/src/pith_apps/presets"
# v_head_dim != qk_nope_head_dim, so that swapped head dims fail; aux_loss_alpha 0: transformers has no aux loss
TINY = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
            first_k_dense_replace=1, aux_loss_alpha=0.0, max_position_embeddings=256)
# DeepSeek-V2's YaRN; over 8 rotary dims floor/ceil put the ramp at [1, 3] (untruncated [1.31, 2.81])
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
VARIANTS = {
    # DeepSeek-V2-Lite's shape: plain q_proj, dense layer 0, greedy top-k, cos/sin scale 1, softmax scale 1.26^2
    "lite": dict(rope_parameters=YARN),
    # DeepSeek-V2's: query latent, group-limited routing, scaled weights; cos/sin scale 1.37 / 1.26 (as V3);
    # rms_norm_eps 1e-2 shows whether the latent norms wrongly use it (DeepSeek builds them with 1e-6)
    "full": dict(q_lora_rank=12, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                 routed_scaling_factor=2.5, rms_norm_eps=1e-2, rope_parameters=YARN | dict(mscale=1.0)),
    # no rope scaling, every layer MoE
    "plain_rope": dict(q_lora_rank=12, first_k_dense_replace=0,
                       rope_parameters=dict(rope_type="default", rope_theta=500.0)),
}


def hf_config(**overrides):
    return transformers.DeepseekV2Config(**(TINY | overrides))


def our_config(**overrides):
    return DeepseekV2Config.from_dict(dict(model_type="deepseek_v2") | TINY | dict(rope_parameters=YARN) | overrides)


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_transformers(variant, tmp_path):
    hf_model = save_tiny_hf_model(hf_config(**VARIANTS[variant]), tmp_path)
    ours = load_ours(DeepseekV2Config, DeepseekV2ForCausalLM, tmp_path)
    # 64 positions: a wrong softmax scale cannot hide (at position 0 the softmax has one key)
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(0))
    # logits 1e-5, loss 1e-5 and gradients 1e-4 relative (hf_compare); names and in-memory layouts are the same
    compare_forward_and_backward(hf_model, ours, ids, {name: name for name, _ in ours.named_parameters()})


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v2")
    save_tiny_hf_model(hf_config(**VARIANTS["full"]), path)
    return path


def test_export_then_import_is_bit_exact_and_transformers_reproduces_our_logits(full_dir, tmp_path):
    check_export_round_trip(DeepseekV2Config, DeepseekV2ForCausalLM, full_dir, tmp_path / "export")


def hand_balance_loss(scores, expert_ids, batch, seq_aux):
    """DeepSeek-V2's expert-level balance loss: over the T tokens of a sequence, f_i = E / (K T) * (number of
    tokens that chose expert i) and P_i = mean_t s_{i,t}; loss = sum_i f_i P_i, averaged over the sequences.
    Without seq_aux the whole batch counts as one sequence."""
    experts, top_k = scores.shape[-1], expert_ids.shape[-1]
    if seq_aux:
        sequences = list(zip(scores.view(batch, -1, experts), expert_ids.view(batch, -1, top_k)))
    else:
        sequences = [(scores, expert_ids)]
    total = 0.0
    for seq_scores, seq_ids in sequences:
        tokens = seq_scores.shape[0]
        for i in range(experts):
            total = total + experts / (top_k * tokens) * (seq_ids == i).sum() * seq_scores[:, i].mean()
    return total / len(sequences)


def tiny_model(**overrides):
    model = DeepseekV2ForCausalLM(our_config(**overrides))
    randomize(model, seed=0, std=0.2)   # routing far from uniform
    return model


@pytest.mark.parametrize("seq_aux", [True, False])
def test_balance_loss_gradient_equals_ce_plus_alpha_times_the_formula(seq_aux):
    """Same weights, same tokens: gradient of CE with the loss attached (alpha 0.3) = gradient of
    CE + 0.3 * hand_balance_loss of each MoE layer's router scores, for every parameter (float32, 1e-5)."""
    model = tiny_model(**VARIANTS["full"] | dict(aux_loss_alpha=0.3, seq_aux=seq_aux, num_hidden_layers=3))
    ids = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(3))
    labels = shifted_labels(ids)
    tokens = (labels != -100).sum()

    def gradients(extra_loss=lambda: 0.0):
        model.zero_grad()
        (model.loss_sum(ids, labels) / tokens + extra_loss()).backward()
        return {name: param.grad.clone() for name, param in model.named_parameters()}

    attached = gradients()
    captured = []
    for layer in list(model.layers.values())[1:]:
        layer.balance.coef = 0.0   # from here on, nothing attached
        def route(scores, original=layer.route, layer=layer):
            expert_ids, weights = original(scores)
            captured.append((layer, scores, expert_ids))
            return expert_ids, weights
        layer.route = route
    expected = gradients(lambda: 0.3 * sum(hand_balance_loss(s, e, 3, seq_aux) for _, s, e in captured))
    assert len(captured) == 2
    for name, grad in attached.items():
        assert relative_error(grad, expected[name]) < 1e-5, name
    for layer, scores, expert_ids in captured:   # the value too, not only its gradient
        hand = hand_balance_loss(scores, expert_ids, 3, seq_aux)
        ours = layer.balance.scale * layer.balance.loss_share(scores, expert_ids, 3)
        assert abs(ours.item() - hand.item()) < 1e-6 * hand.item()
    ce_only = gradients()
    router = "model.layers.1.mlp.gate.weight"
    assert relative_error(attached[router], ce_only[router]) > 1e-2   # the loss does reach the router


# 8 experts in 4 groups of 2. Greedy top-3: experts 0, 2, 4. Group-limited (2 groups, by their best expert):
# groups 0 and 1, so experts 0, 2 and then 1 (0.05 beats 3's 0.01).
SCORES = torch.tensor([[0.30, 0.05, 0.29, 0.01, 0.28, 0.0, 0.07, 0.0]])


@pytest.mark.parametrize("overrides,expected_ids,expected_weights", [
    (dict(routed_scaling_factor=2.0), [0, 2, 4], [0.60, 0.58, 0.56]),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0),
     [0, 2, 1], [0.60, 0.58, 0.10]),
    # norm_topk_prob (DeepSeek's code, not transformers'): renormalized to sum 1 and then NOT scaled
    (dict(norm_topk_prob=True, routed_scaling_factor=2.0), [0, 2, 4], [0.30 / 0.87, 0.29 / 0.87, 0.28 / 0.87]),
])
def test_routing_picks_and_weights(overrides, expected_ids, expected_weights):
    layer = DeepseekV2DecoderLayer(our_config(**overrides), moe=True, parallel=Parallel(), balance=None)
    expert_ids, weights = layer.route(SCORES)
    order = weights[0].argsort(descending=True)
    assert expert_ids[0, order].tolist() == expected_ids
    assert torch.allclose(weights[0, order], torch.tensor(expected_weights), rtol=1e-6, atol=0)


def test_lite_preset_is_deepseek_v2_lite_in_both_config_forms(tmp_path):
    """The preset keeps the published form (rope_theta + rope_scaling); transformers v5 rewrites it as
    rope_parameters. Both read the same; the model has MODELS.md's 15.7B parameters and softmax scale 0.11472."""
    published = json.loads((PRESETS / "deepseek_v2_lite.json").read_text())
    transformers.DeepseekV2Config(**{k: v for k, v in published.items() if k != "model_type"}).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in saved and saved["rope_parameters"]["rope_type"] == "yarn"
    cfg = DeepseekV2Config.from_dict(published)
    assert DeepseekV2Config.from_dict(saved) == cfg
    assert (cfg.rope_type, cfg.q_lora_rank, cfg.first_k_dense_replace) == ("yarn", None, 1)
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(cfg)
    assert abs(sum(p.numel() for p in model.parameters()) / 15.7e9 - 1) < 0.005
    assert abs(model.layers[0].self_attn.scale - 0.11472) < 1e-5


def test_tiny_preset_starts_near_uniform():
    cfg = DeepseekV2Config.from_dict(json.loads((PRESETS / "deepseek_v2_tiny.json").read_text()))
    model = DeepseekV2ForCausalLM(cfg)
    model.init_weights(0)
    ids = torch.randint(0, 257, (2, 128), generator=torch.Generator().manual_seed(0))
    loss = model.loss_sum(ids, shifted_labels(ids)) / (2 * 127)
    assert abs(loss.item() - math.log(257)) < 0.05   # small init: logits near 0, so near ln 257 = 5.549 nats
    assert cfg.first_k_dense_replace == 1 and cfg.num_hidden_layers > 1


@pytest.mark.parametrize("change,message", [
    (dict(topk_method="noaux_tc"),
     "topk_method='noaux_tc' is not supported for deepseek_v2; valid: 'greedy', 'group_limited_greedy'"),
    (dict(attention_bias=True), "attention_bias=True is not supported for deepseek_v2; valid: False"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace=3 must be at most num_hidden_layers=2"),
    (dict(q_lora_rank=0), "q_lora_rank=0 must be a positive integer"),
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "rope_type='dynamic' is not supported"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=40.0)),
     "rope_scaling \\(yarn\\) is missing original_max_position_embeddings"),
    (dict(topk_method="group_limited_greedy", n_group=3), "n_group=3 must divide n_routed_experts=8"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1),
     "topk_group=1 groups of 2 experts hold fewer than num_experts_per_tok=3"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 must be at most n_routed_experts=8"),
    (dict(model_type="qwen3_moe"), "model_type='qwen3_moe' does not match this model; expected 'deepseek_v2'"),
])
def test_bad_config_names_the_value(change, message):
    with pytest.raises(ConfigError, match=message):
        our_config(**change)
