import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import relative_error
from hf_compare import check_export_round_trip, compare_forward_and_backward, load_ours, save_tiny_hf_model, shifted_labels
from pith_apps.config import ConfigError
from pith_apps import hf_checkpoint
from pith_apps.hf_checkpoint import load_hf_weights, mxfp4_decode, save_hf
from pith_apps.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM


def qwen3_config(**overrides):
    args = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                norm_topk_prob=True, router_aux_loss_coef=0.0, rope_theta=10000.0)
    return transformers.Qwen3MoeConfig(**(args | overrides))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf_model(qwen3_config(), path)
    return path


def test_qwen3_matches_transformers(tmp_path):
    hf_model = save_tiny_hf_model(qwen3_config(), tmp_path)
    ours = load_ours(Qwen3MoeConfig, Qwen3MoeForCausalLM, tmp_path)
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(0))
    # parameter names and in-memory layouts are the same in both models (stacked experts included)
    compare_forward_and_backward(hf_model, ours, ids, {name: name for name, _ in ours.named_parameters()})


def test_qwen3_aux_loss_gradient_matches_transformers(tmp_path):
    """One layer, so transformers' aux loss over all layers' router logits equals our per-layer one."""
    hf_model = save_tiny_hf_model(qwen3_config(num_hidden_layers=1, router_aux_loss_coef=0.3,
                                               output_router_logits=True), tmp_path)
    ours = load_ours(Qwen3MoeConfig, Qwen3MoeForCausalLM, tmp_path)
    ids = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    hf_model(input_ids=ids, labels=ids).loss.backward()   # with output_router_logits: CE + coef * aux
    labels = shifted_labels(ids)
    (ours.loss_sum(ids, labels) / (labels != -100).sum()).backward()   # aux reaches the router in backward
    name = "model.layers.0.mlp.gate.weight"
    assert relative_error(ours.get_parameter(name).grad, hf_model.get_parameter(name).grad) < 1e-4


def test_export_then_import_is_bit_exact_and_transformers_reproduces_our_logits(qwen3_dir, tmp_path):
    check_export_round_trip(Qwen3MoeConfig, Qwen3MoeForCausalLM, qwen3_dir, tmp_path / "export")


def test_mxfp4_decode_matches_an_independent_decode():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(120, 134, (2, 3, 2), generator=generator, dtype=torch.uint8)
    magnitudes = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    expected = torch.empty(2, 3, 64)
    for index in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(2), torch.arange(16)).tolist():
        e, row, group, byte = index
        value = int(blocks[e, row, group, byte])
        for half, code in enumerate((value % 16, value // 16)):
            sign = -1.0 if code >= 8 else 1.0
            expected[e, row, group * 32 + byte * 2 + half] = sign * magnitudes[code % 8] * 2.0 ** (int(scales[e, row, group]) - 127)
    assert torch.equal(mxfp4_decode(blocks, scales, torch.float32), expected)


def test_missing_tensor_is_named_with_its_shape(qwen3_dir, tmp_path):
    tensors = load_file(qwen3_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(json.loads((qwen3_dir / "config.json").read_text())))
    with pytest.raises(ConfigError, match=r"no tensor 'model.layers.1.mlp.experts.3.up_proj.weight' \(expected shape \(40, 48\)\)"):
        load_hf_weights(model, tmp_path)


def test_wrong_shape_is_named_with_both_shapes(qwen3_dir):
    config = json.loads((qwen3_dir / "config.json").read_text()) | {"moe_intermediate_size": 32}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(config))
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' .* has shape \(40, 48\); the config expects \(32, 48\)"):
        load_hf_weights(model, qwen3_dir)


def test_wrong_model_type_is_named(qwen3_dir):
    config = json.loads((qwen3_dir / "config.json").read_text()) | {"model_type": "deepseek_v2"}
    with pytest.raises(ConfigError, match="model_type='deepseek_v2' does not match this model; expected 'qwen3_moe'"):
        Qwen3MoeConfig.from_dict(config)


def test_a_rank_reads_only_the_tensors_it_holds(qwen3_dir, tmp_path, monkeypatch):
    """A pipeline rank builds only its layers (here layer 1, with the final norm and LM head): the loader fills
    exactly those and opens only the shards that hold them."""
    config = json.loads((qwen3_dir / "config.json").read_text())
    full = load_ours(Qwen3MoeConfig, Qwen3MoeForCausalLM, qwen3_dir)
    save_hf(full, config, tmp_path / "sharded", max_shard_bytes=20_000)
    rank = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(config), held_layers=[1])
    opened = []
    real_safe_open = hf_checkpoint.safe_open
    monkeypatch.setattr(hf_checkpoint, "safe_open", lambda path, *args: opened.append(path.name) or real_safe_open(path, *args))
    load_hf_weights(rank, tmp_path / "sharded")

    full_params = dict(full.named_parameters())
    held = dict(rank.named_parameters())
    assert all(torch.equal(param, full_params[name]) for name, param in held.items()) and len(held) == 13
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(opened) == sorted({index[name] for name, _ in rank.hf_views()})
    assert len(set(index.values())) > len(opened)
