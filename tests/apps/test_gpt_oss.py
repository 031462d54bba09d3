"""GPT-OSS against transformers on tiny random checkpoints saved with save_pretrained: sliding window
shorter than the sequence, learned sinks, YaRN (truncate=False), clamped experts; plus MXFP4 import,
export round trip, config reading and the presets."""
import json
from pathlib import Path

import pytest
from torch.nn.attention.flex_attention import flex_attention
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import relative_error
from hf_compare import GRAD_TOLERANCE, check_export_round_trip, compare_forward_and_backward, load_ours, save_tiny_hf_model, shifted_labels
from pith_apps.config import ConfigError, read_json
from pith_apps.hf_checkpoint import load_hf_weights
from pith_apps.models.gpt_oss import (GptOssConfig, GptOssExperts, GptOssForCausalLM, flex_attention_with_sinks,
                                     materialized_attention_with_sinks)
from pith_apps.models.layers import yarn_inv_freq
from pith_engine.parallel import Parallel

PRESETS = Path(__file__).parents[2] / "packages/pith-apps/src/pith_apps/presets"
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")   # [E, in, out] in transformers, [E, out, in] here
SEQ = 64


def gpt_oss_config(**overrides):
    """hidden and intermediate are multiples of 32 (MXFP4 blocks); window 16 < SEQ; YaRN with truncate=False,
    whose ramp (0 .. 1.41) differs from the truncated one (0 .. 2)."""
    args = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.0,
                max_position_embeddings=256, rope_parameters=dict(
                    rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=32))
    return transformers.GptOssConfig(**(args | overrides))


def save_gpt_oss(hf_config, path):
    """A random transformers model, its gate/up weights scaled so that about a fifth of the gate and two
    fifths of the up pre-activations lie beyond the clamp at 7 (seen: 0.19 / 0.39 in layer 0), and sinks
    of std 1 so that they take visible weight."""
    hf_model = save_tiny_hf_model(hf_config, path)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("gate_up_proj") or name.endswith("sinks"):
                param.mul_(10)
    hf_model.save_pretrained(path)
    return hf_model


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return save_gpt_oss(gpt_oss_config(), path), path


def random_ids(seed, batch=2):
    return torch.randint(0, 97, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def test_gpt_oss_matches_transformers(gpt_oss_dir):
    hf_model, path = gpt_oss_dir
    ours = load_ours(GptOssConfig, GptOssForCausalLM, path)
    names = [name for name, _ in ours.named_parameters()]
    compare_forward_and_backward(hf_model, ours, random_ids(0),
                                 {name: name for name in names if not name.endswith(EXPERT_WEIGHTS)})
    for name in filter(lambda name: name.endswith(EXPERT_WEIGHTS), names):
        ours_grad, hf_grad = ours.get_parameter(name).grad.transpose(1, 2), hf_model.get_parameter(name).grad
        assert relative_error(ours_grad, hf_grad) < GRAD_TOLERANCE, name


def test_aux_loss_gradient_matches_transformers(tmp_path):
    """One layer, so transformers' aux loss over all layers' router logits equals our per-layer one."""
    hf_model = save_gpt_oss(gpt_oss_config(num_hidden_layers=1, layer_types=["sliding_attention"],
                                           router_aux_loss_coef=0.3, output_router_logits=True), tmp_path)
    ours = load_ours(GptOssConfig, GptOssForCausalLM, tmp_path)
    ids = random_ids(1)
    hf_model(input_ids=ids, labels=ids).loss.backward()   # with output_router_logits: CE + coef * aux
    labels = shifted_labels(ids)
    (ours.loss_sum(ids, labels) / (labels != -100).sum()).backward()   # aux reaches the router in backward
    for name in ("model.layers.0.mlp.router.weight", "model.layers.0.mlp.router.bias"):
        assert relative_error(ours.get_parameter(name).grad, hf_model.get_parameter(name).grad) < GRAD_TOLERANCE, name


def mxfp4_encode_random(experts, outputs, inputs, generator):
    """Random E2M1 codes and exponents -> (values [E, out, in] computed here, blocks, scales as stored)."""
    codes = torch.randint(0, 16, (experts, outputs, inputs), generator=generator)
    exponents = torch.randint(124, 130, (experts, outputs, inputs // 32), generator=generator)
    magnitude = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes % 8]
    values = torch.where(codes >= 8, -magnitude, magnitude) * torch.exp2(exponents - 127.0).repeat_interleave(32, -1)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)   # low nibble = even element
    return values, blocks.view(experts, outputs, inputs // 32, 16), exponents.to(torch.uint8)


@pytest.mark.parametrize("experts,top_k", [(6, 2), (128, 4)])   # 128 of top-4: gpt-oss-120b's expert layout
def test_mxfp4_experts_load_as_the_same_model_as_bf16(tmp_path, experts, top_k):
    bf16_dir, mxfp4_dir = tmp_path / "bf16", tmp_path / "mxfp4"
    config = gpt_oss_config(num_local_experts=experts, num_experts_per_tok=top_k)
    hf_model = save_tiny_hf_model(config, bf16_dir).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    packed = {}
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(EXPERT_WEIGHTS):
                experts, inputs, outputs = param.shape
                values, packed[f"{name}_blocks"], packed[f"{name}_scales"] = mxfp4_encode_random(
                    experts, outputs, inputs, generator)
                param.copy_(values.transpose(1, 2))   # exactly representable in bf16
    hf_model.save_pretrained(bf16_dir)
    tensors = load_file(bf16_dir / "model.safetensors")
    tensors = {name: t for name, t in tensors.items() if not name.endswith(EXPERT_WEIGHTS)}
    mxfp4_dir.mkdir()
    save_file(tensors | packed, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4_dir / "config.json").write_text(json.dumps(config))

    bf16 = load_ours(GptOssConfig, GptOssForCausalLM, bf16_dir)
    quantized = load_ours(GptOssConfig, GptOssForCausalLM, mxfp4_dir)
    for (name, a), (_, b) in zip(bf16.state_dict().items(), quantized.state_dict().items()):
        assert torch.equal(a, b), name
    for name in filter(lambda name: name.endswith(EXPERT_WEIGHTS), bf16.state_dict()):
        expected = hf_model.get_parameter(name).float().transpose(1, 2)
        assert torch.equal(quantized.get_parameter(name), expected), name
    # expert-parallel rank 1 of 2 reads the second half of each stacked expert tensor, from bf16 and from MXFP4
    for directory in (bf16_dir, mxfp4_dir):
        rank_experts = GptOssExperts(quantized.config, Parallel(ep=2, rank=1))

        class RankModel(torch.nn.Module):   # what the rank holds: these experts of layer 1
            def __init__(self):
                super().__init__()
                self.experts = rank_experts

            def hf_views(self):
                return self.experts.hf_views("model.layers.1.mlp.experts")
        load_hf_weights(RankModel(), directory)
        for name, param in rank_experts.named_parameters():
            assert torch.equal(param, quantized.layers[1].mlp.experts.get_parameter(name)[experts // 2:]), name


def test_export_then_import_is_bit_exact_and_transformers_reproduces_our_logits(gpt_oss_dir, tmp_path):
    check_export_round_trip(GptOssConfig, GptOssForCausalLM, gpt_oss_dir[1], tmp_path / "export")


# gpt-oss-20b's config.json as published: rope_scaling with a top-level rope_theta, MXFP4 experts
PUBLISHED_20B = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0, eos_token_id=200002,
    experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096,
    initializer_range=0.02, intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4,
    num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32, output_router_logits=False,
    pad_token_id=199999, rms_norm_eps=1e-05, rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128,
    swiglu_limit=7.0, tie_word_embeddings=False, use_cache=True, vocab_size=201088,
    quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]),
    rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, original_max_position_embeddings=4096,
                      rope_type="yarn", truncate=False))


def test_published_config_reads_as_the_20b_preset_and_as_transformers_reads_it():
    cfg = GptOssConfig.from_dict(PUBLISHED_20B)
    assert cfg == GptOssConfig.from_dict(read_json(PRESETS / "gpt_oss_20b.json"))
    assert abs(cfg.rope_attention_factor - 1.34657) < 1e-5 and not cfg.rope_truncate   # 0.1 * ln(32) + 1
    hf_config = transformers.GptOssConfig(**PUBLISHED_20B)
    hf_inv_freq, hf_attention_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    inv_freq = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_position,
                             cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_truncate)
    assert relative_error(inv_freq, hf_inv_freq) < 1e-6 and cfg.rope_attention_factor == hf_attention_factor
    with torch.device("meta"):
        params = sum(p.numel() for p in GptOssForCausalLM(cfg).parameters())
    assert abs(params / 1e9 - 20.9) < 0.05   # MODELS.md: 20.9B total


def test_the_120b_preset_is_the_20b_with_36_layers_of_128_experts_and_116_8b_parameters():
    """gpt-oss-120b's published config.json differs from the 20b's in depth and expert count only; the total
    (OpenAI's model card: 116.8B) follows from the shapes."""
    big = read_json(PRESETS / "gpt_oss_120b.json")
    small = read_json(PRESETS / "gpt_oss_20b.json")
    assert {k for k in big if big[k] != small[k]} == {"num_hidden_layers", "num_local_experts", "layer_types"}
    assert big["num_hidden_layers"] == 36 and big["num_local_experts"] == 128
    assert big["layer_types"] == ["sliding_attention", "full_attention"] * 18
    with torch.device("meta"):
        params = sum(p.numel() for p in GptOssForCausalLM(GptOssConfig.from_dict(big)).parameters())
    assert abs(params / 1e9 - 116.8) < 0.05


def test_tiny_preset_and_a_config_without_rope_settings_read_as_transformers_defaults():
    tiny = GptOssConfig.from_dict(read_json(PRESETS / "gpt_oss_tiny.json"))
    assert tiny.vocab_size == 257 and tiny.layer_types == ["sliding_attention", "full_attention"]
    bare = {k: v for k, v in PUBLISHED_20B.items() if k not in ("rope_scaling", "rope_theta", "layer_types")}
    assert GptOssConfig.from_dict(bare) == GptOssConfig.from_dict(PUBLISHED_20B)   # GptOssConfig's defaults


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["sliding_attention"]),
     r"layer_types=\['sliding_attention'\] must have num_hidden_layers=24 entries"),
    (dict(layer_types=["local"] * 24), "each one of 'sliding_attention', 'full_attention'"),
    (dict(num_key_value_heads=5), "num_attention_heads=64 must be a multiple of num_key_value_heads=5"),
    (dict(num_experts_per_tok=33), "num_experts_per_tok=33 must be at most num_local_experts=32"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_type='linear' is not supported for gpt_oss; valid: 'yarn'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"missing \['original_max_position_embeddings'\]"),
    (dict(quantization_config={"quant_method": "fp8"}), "quant_method='fp8' is not supported; valid: 'mxfp4'"),
    (dict(sliding_window=0), "sliding_window=0 must be a positive integer"),
    (dict(attention_bias=False), "attention_bias=false is not supported"),
    (dict(model_type="qwen3_moe"), "model_type='qwen3_moe' does not match this model; expected 'gpt_oss'"),
])
def test_bad_config_names_the_value(change, message):
    with pytest.raises(ConfigError, match=message):
        GptOssConfig.from_dict(PUBLISHED_20B | change)


def sink_attention_inputs(device, seq=256, heads=4, kv_heads=2, dim=16):
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, seq, dim, generator=generator).to(device) for h in (heads, kv_heads, kv_heads))
    return q, k, v, (torch.randn(heads, generator=generator) * 2).to(device)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 100])
def test_flex_attention_with_sinks_matches_the_materialized_reference_forward(window):
    """The rescale by sigmoid(lse - sink) equals the extra softmax column (forward; flex_attention has no
    CPU backward, the GPU test below covers it). float32: summation order only."""
    q, k, v, sinks = sink_attention_inputs("cpu")
    with torch.no_grad():   # eager flex_attention: compiled on CPU it returns no log-sum-exp
        flex = flex_attention_with_sinks(q, k, v, sinks, window, 0.25, attend=flex_attention)
    assert relative_error(flex, materialized_attention_with_sinks(q, k, v, sinks, window, 0.25)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention runs on CUDA (bench machine)")
def test_flex_attention_with_sinks_on_cuda_matches_forward_and_backward():
    inputs = [t.requires_grad_() for t in sink_attention_inputs("cuda")]
    reference = [t.detach().clone().requires_grad_() for t in inputs]
    grad = torch.randn_like(inputs[0])
    flex_attention_with_sinks(*inputs, 100, 0.25).backward(grad)
    materialized_attention_with_sinks(*reference, 100, 0.25).backward(grad)
    for got, expected in zip(inputs, reference):
        assert relative_error(got.grad, expected.grad) < 1e-4   # float32, fused vs materialized softmax
