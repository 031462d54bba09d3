"""The engine-model contract (pith_engine.contract): each family meets it, the engine reads models only
through it, and its pieces run in order give the model's loss."""
import inspect

import pytest
import torch

import pith_engine.checkpoint as checkpoint
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine.compile import compile_stages
from pith_engine.contract import MoeLayer, MoeModel, check_model, expert_stacks, moe_layers
from pith_engine.data_parallel import pair_expert_wgrads, shard_model
from pith_engine.moe import run_moe_layer


def tiny(family, layers=None):
    config_cls, model_cls = MODELS[family]
    data = read_json(PRESETS / f"{family}_tiny.json")
    if layers:
        data |= {"num_hidden_layers": layers}
        if "layer_types" in data:   # GPT-OSS's alternation (Qwen3.5's default: every fourth layer full attention)
            data["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    model = model_cls(config_cls.from_dict(data))
    model.init_weights(seed=2)
    return model


@pytest.mark.parametrize("family", list(MODELS))
def test_each_family_meets_the_contract_and_names_its_expert_stacks(family):
    model = tiny(family)
    check_model(model)
    stacks = expert_stacks(model)
    assert list(stacks.values()) == [layer.experts for layer in moe_layers(model)] and stacks
    for name, param in model.named_parameters():   # every stacked expert tensor, and only those, is under one
        prefix = name.rsplit(".", 1)[0]
        if prefix in stacks:
            assert param.shape[0] == stacks[prefix].local_experts, name
        else:
            assert ".experts." not in name, name


@pytest.mark.parametrize("family", list(MODELS))
def test_the_contract_pieces_in_order_give_the_models_loss(family):
    """The model's forward chunk by chunk (hidden states of layers 0-1, then layers 2-3 on them with the labels), as a
    pipeline runs it, equals loss_sum (same fp32 ops on the CPU, so bit-equal); a chunk not ending the model
    returns hidden states."""
    model = tiny(family, layers=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    x = model(ids, labels, layers=[0, 1])
    assert x.shape == (2, 16, model.hidden_size)
    assert torch.equal(model(ids, labels, hidden=x, layers=[2, 3]), model.loss_sum(ids, labels))


def test_a_model_that_misses_part_of_the_contract_is_named_with_what_it_lacks():
    model = tiny("qwen3")
    with pytest.raises(TypeError, match=r"^layer 1 \(Plain\) is not a pith_engine MoeLayer: it lacks num_experts, "
                                        r"experts, fullgraph, attention_stage, expert_stage, aggregate_stage$"):
        model.model.layers["1"] = type("Plain", (torch.nn.Module,), {"is_moe": True})()
        check_model(model)
    with pytest.raises(TypeError, match=r"^Sequential is not a pith_engine MoeModel: it lacks layers, hidden_size, wgrad_pairs, "
                                        r"loss_sum$"):
        check_model(torch.nn.Sequential())


@pytest.mark.parametrize("function, parameter, protocol", [
    (compile_stages, "model", MoeModel), (shard_model, "model", MoeModel), (pair_expert_wgrads, "model", MoeModel),
    (checkpoint.save, "model", MoeModel), (checkpoint.load, "model", MoeModel),
    (checkpoint.load_weights, "model", MoeModel), (checkpoint.save_weights, "model", MoeModel),
    (checkpoint.canonical_entries, "model", MoeModel), (run_moe_layer, "layer", MoeLayer)])
def test_the_engine_functions_that_read_a_model_name_the_contract(function, parameter, protocol):
    assert inspect.signature(function).parameters[parameter].annotation is protocol
