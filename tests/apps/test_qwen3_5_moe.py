"""Qwen3.5-MoE against transformers' Qwen3_5MoeForCausalLM: tiny random checkpoints written by save_pretrained, both
layer kinds (Gated DeltaNet and gated full attention), sequences longer than one chunk of the delta rule."""
import copy

import pytest
import torch
import transformers

from conftest import relative_error
from hf_compare import (GRAD_TOLERANCE, check_export_round_trip, compare_forward_and_backward, load_ours,
                        randomize, save_tiny_hf_model, shifted_labels)
from pith_apps.config import ConfigError
from pith_apps.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM
from pith_apps.hf_checkpoint import save_hf
from pith_apps.options import hf_config_data, model_config, parse_args

SEQ = 100   # the delta rule's chunks are 64 tokens: one whole chunk, one padded


def qwen3_5_config(**overrides):
    """Three linear-attention layers and one full (the released pattern), two key heads serving four value heads,
    a rotary quarter of 8 dims of the 32 of a head, the aux loss off (transformers' loss leaves it out)."""
    args = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
    return transformers.Qwen3_5MoeTextConfig(**(args | overrides))


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return save_tiny_hf_model(qwen3_5_config(), path), path


def random_ids(seed, batch=2):
    return torch.randint(0, 97, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def test_qwen3_5_matches_transformers(qwen3_5_dir):
    """Logits within 1e-5, the loss within 1e-5 of it, and every parameter's gradient within 1e-4 (float32): the
    delta rule's decay (A_log, dt_bias), convolution, gates and zero-centered norms included."""
    hf_model, path = qwen3_5_dir
    ours = load_ours(Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, path)
    assert [layer.kind for layer in ours.layers.values()] == ["linear_attention"] * 3 + ["full_attention"]
    stacked = ("experts.gate_up_proj", "experts.down_proj")
    names = [name for name, _ in ours.named_parameters()]
    compare_forward_and_backward(hf_model, ours, random_ids(0), {n: n for n in names if not n.endswith(stacked)})
    for name in filter(lambda name: name.endswith(stacked), names):
        assert relative_error(ours.get_parameter(name).grad, hf_model.get_parameter(name).grad) < GRAD_TOLERANCE, name


def test_with_documents_each_is_transformers_run_alone(qwen3_5_dir):
    """--doc-mask: two rows of documents (of 1, 63, 1, 30 and 5 tokens; of 64 and 36: resets at token 0, on the
    delta rule's chunk boundary, on consecutive tokens) give the logits transformers gives each document alone
    (1e-5; seen 5.6e-6), the loss over every document's tokens but its last and the gradients of theirs summed over
    the documents: every parameter within the unmasked test's 1e-4 (seen 6.2e-5), A_log and dt_bias within 2e-4
    (seen 9.1e-5; transformers' own, float32 as ours, are up to 1.1e-4 from the float64 gradients here). Before the
    rule's resets were exact, a log-decay of -80 at each document's first token cost a 64-token chunk's cumulative
    decays their float32 precision: logits 2.0e-5, dt_bias 4.5e-4, A_log 4.1e-4, in_proj_a 2.2e-4."""
    from pith_apps.models.layers import document_starts
    hf_model, path = qwen3_5_dir
    hf_model.zero_grad()   # (the module's other tests leave theirs)
    ours = load_ours(Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, path)
    lengths, ids = [[1, 63, 1, 30, 5], [64, 36]], random_ids(4)
    docs = torch.stack([torch.arange(len(row)).repeat_interleave(torch.tensor(row)) for row in lengths])
    labels = shifted_labels(ids).masked_fill(document_starts(docs).roll(-1, 1), -100)   # no label past a document
    pieces = []   # (row, first token, end) of each document
    for row, sizes in enumerate(lengths):
        pieces += [(row, end - n, end) for n, end in zip(sizes, torch.tensor(sizes).cumsum(0).tolist())]
    theirs = [hf_model(input_ids=ids[row:row + 1, start:end]).logits[0] for row, start, end in pieces]
    logits = ours(ids, docs=docs)
    assert relative_error(torch.cat([logits[row, start:end] for row, start, end in pieces]).detach(),
                          torch.cat(theirs).detach()) < 1e-5
    count = (labels != -100).sum()
    their_loss = sum(torch.nn.functional.cross_entropy(out[:-1], ids[row, start + 1:end], reduction="sum")
                     for out, (row, start, end) in zip(theirs, pieces)) / count
    loss = ours.loss_sum(ids, labels, docs) / count
    assert abs(loss.item() - their_loss.item()) < 1e-5 * their_loss.item()
    loss.backward()
    their_loss.backward()
    for name, param in ours.named_parameters():
        tolerance = 2e-4 if name.endswith(("A_log", "dt_bias")) else GRAD_TOLERANCE
        assert relative_error(param.grad, hf_model.get_parameter(name).grad) < tolerance, name


def test_aux_loss_gradient_matches_transformers(tmp_path):
    """One layer, so transformers' aux loss over all layers' router logits equals our per-layer one."""
    hf_model = save_tiny_hf_model(qwen3_5_config(num_hidden_layers=1, layer_types=["linear_attention"],
                                                 router_aux_loss_coef=0.3, output_router_logits=True), tmp_path)
    ours = load_ours(Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, tmp_path)
    ids = random_ids(1)
    hf_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()   # (its cache wants an attention layer)
    labels = shifted_labels(ids)
    (ours.loss_sum(ids, labels) / (labels != -100).sum()).backward()
    name = "model.layers.0.mlp.gate.weight"
    assert relative_error(ours.get_parameter(name).grad, hf_model.get_parameter(name).grad) < GRAD_TOLERANCE


def test_export_then_import_is_bit_exact_and_transformers_reproduces_our_logits(qwen3_5_dir, tmp_path):
    check_export_round_trip(Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, qwen3_5_dir[1], tmp_path / "export")


def test_a_config_reads_as_transformers_reads_it():
    """Without layer_types every fourth layer is full attention; without rope settings theta 10000 and a quarter of
    each head rotary; a released model's config (model_type qwen3_5_moe) is read through its text_config."""
    bare = {k: v for k, v in qwen3_5_config(num_hidden_layers=8).to_dict().items()
            if k not in ("layer_types", "rope_parameters")}
    cfg, theirs = Qwen3_5MoeConfig.from_dict(bare), transformers.Qwen3_5MoeTextConfig(**bare)
    assert cfg.layer_types == theirs.layer_types and cfg.layer_types[3::4] == ["full_attention"] * 2
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"] == 10000.0 and cfg.partial_rotary_factor == 0.25
    assert Qwen3_5MoeConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": bare}) == cfg


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "full_attention"]),
     "must give one of linear_attention, full_attention"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 of linear_num_key_heads=2"),
    (dict(attention_bias=True), "attention_bias must be false"),
])
def test_bad_config_names_the_value(change, message):
    data = qwen3_5_config().to_dict() | change
    with pytest.raises(ConfigError, match=message):
        Qwen3_5MoeConfig.from_dict(data)


def test_the_35b_preset_is_transformers_qwen3_5_35b_a3b_text_config():
    """transformers' Qwen3_5MoeTextConfig defaults are Qwen3.5-35B-A3B's (its docstring says so): the preset has
    each of its sizes, and the layer pattern and rotary quarter follow; rope_theta is the released 1e7 (transformers
    leaves it to the file). 34.7B parameters, the '35B'."""
    from pith_apps.config import read_json
    from pith_apps.options import PRESETS
    preset, theirs = read_json(PRESETS / "qwen3_5_35b-a3b.json"), transformers.Qwen3_5MoeTextConfig()
    sizes = [key for key in preset if key not in ("model_type", "rope_parameters")]
    assert len(sizes) == 19 and all(preset[key] == getattr(theirs, key) for key in sizes)
    cfg = Qwen3_5MoeConfig.from_dict(preset)
    assert cfg.layer_types == theirs.layer_types and cfg.partial_rotary_factor == 0.25 and cfg.rope_theta == 1e7
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3_5MoeForCausalLM(cfg).parameters())
    assert abs(params / 1e9 - 34.66) < 0.01


def test_transformers_and_ours_are_the_same_linear_attention_rounded_alike(tmp_path):
    """Layer 0's Gated DeltaNet on random hidden states: ours in float64 is the function itself; ours in float32
    and transformers' (whose rule always runs in float32) are both within 2e-5 of it in the output and every
    parameter's gradient (seen 5.6e-7 and 4.7e-6 for both): what separates the two float32 runs is rounding, which
    the delta rule's triangular solves amplify (their gradients differ by up to 6.7e-5 at the weights' std 0.1)."""
    hf_model = save_tiny_hf_model(qwen3_5_config(), tmp_path)
    ours = load_ours(Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, tmp_path)
    theirs, mine = hf_model.model.layers[0].linear_attn, ours.model.layers["0"].linear_attn
    exact = copy.deepcopy(mine).double()
    x, weight = (torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(seed)) for seed in (0, 1))
    outputs = [module(x.to(dtype)) for module, dtype in ((theirs, torch.float32), (mine, torch.float32),
                                                         (exact, torch.float64))]
    for out in outputs:
        (out * weight.to(out.dtype)).sum().backward()
    wanted = dict(exact.named_parameters())
    for module, out in zip((theirs, mine), outputs):
        assert relative_error(out.detach(), outputs[2].detach()) < 2e-5
        for name, param in module.named_parameters():
            assert relative_error(param.grad, wanted[name].grad) < 2e-5, name


def test_a_released_multimodal_checkpoint_gives_its_language_model(tmp_path):
    """A checkpoint as Qwen3.5-35B-A3B is released (Qwen3_5MoeForConditionalGeneration: a vision tower, the text
    model under model.language_model., config model_type qwen3_5_moe): our model reads the text model's weights and
    gives transformers' logits for text within 1e-5; the app cuts it with --layers (the text config's layers) and
    exports it as a text model that transformers reads back."""
    text = qwen3_5_config().to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    hf_model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(text_config=text,
                                                                                             vision_config=vision))
    randomize(hf_model)
    hf_model.save_pretrained(tmp_path / "released")
    ours = load_ours(Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, tmp_path / "released")
    ids = random_ids(3)
    assert relative_error(ours(ids).detach(), hf_model(input_ids=ids).logits.detach()) < 1e-5
    args = parse_args(["qwen3_5", "--init", str(tmp_path / "released"), "--layers", "2"])
    assert hf_config_data(args)["model_type"] == "qwen3_5_moe_text"
    cut = model_config(args)
    assert cut.num_hidden_layers == 2 and cut.layer_types == ["linear_attention"] * 2
    save_hf(ours, hf_config_data(parse_args(["qwen3_5", "--init", str(tmp_path / "released")])), tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    assert type(exported).__name__ == "Qwen3_5MoeForCausalLM"
    assert relative_error(exported(input_ids=ids).logits.detach(), ours(ids).detach()) < 1e-5
