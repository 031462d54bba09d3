"""A module owns its parameters (issue 53): each declares, where it makes them, how they start
(pith_apps.models.layers.declare), whether Hugging Face files hold them and whether they compute in float32.
init_weights applies the declarations: the weights equal, bit for bit, those of the name rules that did this before
(re-implemented here); an undeclared parameter is named in one line; a parameter declared absent from the files
starts as declared at --init, said in one line, and every layout starts from the same values; a float32 parameter
stays float32 in bf16 compute on one process and under FSDP2."""
import zlib

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import pith_apps.train as train_app
from conftest import relative_error
from distributed import run_on_processes
from hf_compare import tiny_hf_folder
from pith_apps.config import ConfigError, read_json
from pith_apps.hf_checkpoint import load_hf_weights, save_hf
from pith_apps.models.layers import declare
from pith_apps.models.qwen3_5_moe import GatedDeltaNet, ZeroCenteredRMSNorm
from pith_apps.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeConfig, Qwen3MoeForCausalLM
from pith_apps.options import MODELS, PRESETS, model_config
from pith_engine.parallel import Parallel

SEED = 3
IDS = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))


def name_rules(model, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights as CausalLM.init_weights made them before the declarations, by rules on the names: norm
    weights 1, biases 0 but the router's, each expert of a stack drawn from (seed, name.expert), everything else
    normal(0, initializer_range) from (seed, name); then Qwen3.5's override: zero-centered norms 0, A_log the log of
    A spread over [1, 16], dt_bias 1."""
    def draw(key, shape):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        return torch.randn(shape, generator=generator) * model.config.initializer_range

    values = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            values[name] = torch.ones(param.shape)
        elif name.endswith("bias") and ".router." not in name:
            values[name] = torch.zeros(param.shape)
        elif ".mlp.experts." in name:
            first = model.get_submodule(name.rsplit(".", 1)[0]).first_expert
            values[name] = torch.stack([draw(f"{name}.{first + e}", param.shape[1:]) for e in range(param.shape[0])])
        else:
            values[name] = draw(name, param.shape)
    for prefix, module in model.named_modules():
        if isinstance(module, ZeroCenteredRMSNorm):
            values[f"{prefix}.weight"] = torch.zeros(module.weight.shape)
        if isinstance(module, GatedDeltaNet):
            values[f"{prefix}.A_log"] = torch.linspace(1, 16, module.v_heads).log()
            values[f"{prefix}.dt_bias"] = torch.ones(module.v_heads)
    return values


@pytest.mark.parametrize("family", list(MODELS))
def test_the_declarations_start_every_family_where_the_name_rules_did(family):
    """Every parameter of each family's tiny preset (and of a pipeline rank's layers: layer 1 alone), bit for bit."""
    config_cls, model_cls = MODELS[family]
    cfg = config_cls.from_dict(read_json(PRESETS / f"{family}_tiny.json"))
    for held in (None, [1]):
        model = model_cls(cfg, held_layers=held)
        model.init_weights(seed=7)
        expected = name_rules(model, 7)
        got = dict(model.named_parameters())
        assert set(got) == set(expected)
        different = [name for name in got if not torch.equal(got[name].detach(), expected[name])]
        assert not different, different


def test_an_undeclared_parameter_and_an_unknown_rule_are_named_in_one_line():
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(read_json(PRESETS / "qwen3_tiny.json")))
    model.model.layers["1"].self_attn.extra = nn.Parameter(torch.empty(4))
    with pytest.raises(TypeError, match=r"^parameter model\.layers\.1\.self_attn\.extra of Qwen3MoeAttention "
                                        r"declares no start; declare it where it is made "
                                        r"\(pith_apps\.models\.layers\.declare\)$"):
        model.init_weights(SEED)
    with pytest.raises(ValueError, match=r"^declare\(Linear, weight='uniform'\): not a rule; valid: normal, zeros, "
                                         r"ones, normal_per_expert, or a function of the draw$"):
        declare(nn.Linear(2, 2), weight="uniform")


class ScaledAttention(Qwen3MoeAttention):
    """Qwen3-MoE's attention, its output scaled by the mean of a per-head `scale` that transformers' files lack,
    declared to start at 1 + the normal draw and to compute in float32; `seen` records what a forward computed with
    (the scale, q_proj's weight's dtype)."""

    def __init__(self, cfg, parallel):
        super().__init__(cfg, parallel)
        self.scale = nn.Parameter(torch.empty(self.heads))
        declare(self, hf=False, fp32=True, scale=lambda draw: 1 + draw)

    def forward(self, x, cos, sin, docs=None):
        self.seen = self.scale.detach().clone(), self.q_proj.weight.dtype
        return super().forward(x, cos, sin, docs) * self.scale.mean().to(x.dtype)


class ScaledQwen3(Qwen3MoeForCausalLM):
    def __init__(self, cfg, parallel=Parallel(), **options):
        super().__init__(cfg, parallel, **options)
        for layer in self.layers.values():
            layer.self_attn = ScaledAttention(cfg, parallel)


def started(root, parallel, dtype=torch.float32):
    """The app's model at the start of a run with --init root/hf: built (build_model) and loaded (init_from_hf)."""
    args = train_app.parse_args(["qwen3", "--init", str(root / "hf"), "--seed", str(SEED), "--device", "cpu"])
    model = train_app.build_model(ScaledQwen3, model_config(args), parallel, torch.device("cpu"), dtype, SEED, 32)
    train_app.init_from_hf(args, model)
    return model


def full_values(model) -> dict:
    """{name: (first expert or 0, the whole tensor, or this rank's experts of a stack)}."""
    values = {}
    for name, param in model.named_parameters():
        first = model.get_submodule(name.rsplit(".", 1)[0]).first_expert if ".mlp.experts." in name else 0
        values[name] = first, (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
    return values


def compute_of(model, ids) -> list:
    """For each layer: (the scale a forward of ids computed with, q_proj's weight's dtype there, the scale's master
    whole)."""
    model.loss_sum(ids, ids)
    scales = [layer.self_attn.scale for layer in model.layers.values()]
    masters = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in scales]
    return [(*layer.self_attn.seen, master) for layer, master in zip(model.layers.values(), masters)]


def scale_grads(model, ids) -> list[torch.Tensor]:
    """The gradients of the scales (whole) from the loss of ids over 64 tokens (2 sequences of 32)."""
    (model.loss_sum(ids, ids) / 64).backward()
    grads = [layer.self_attn.scale.grad for layer in model.layers.values()]
    return [grad.full_tensor() if hasattr(grad, "full_tensor") else grad for grad in grads]


def two_process_starts(rank, world, root):
    """dp 2 and ep 2: the --init start of every parameter and the gradients of the scales (each rank one of the two
    sequences); dp 2 in bf16 compute: what the scales computed with."""
    MODELS["qwen3"] = (Qwen3MoeConfig, ScaledQwen3)   # this process's registry (the app reads it)
    ids, results = IDS[rank:rank + 1], {}
    for dim in ("dp", "ep"):
        model = started(root, Parallel.build(**{dim: 2}))
        results[f"{dim}2"] = full_values(model)
        results[f"{dim}2-grads"] = scale_grads(model, ids)
    results["bf16"] = compute_of(started(root, Parallel.build(dp=2), torch.bfloat16), ids)
    torch.save(results, root / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("declared")
    tiny_hf_folder(root / "hf")
    run_on_processes(2, two_process_starts, root)
    return root


def test_a_parameter_the_files_lack_starts_as_declared_at_init_with_its_line(runs, monkeypatch, capsys):
    """The app trains the scaled model from --init of a transformers folder without the scales: one line says so;
    the loss falls by more than 1 in 3 steps (seen 6.20 -> 4.21). At the start each scale is 1 + normal(0, 0.02)
    drawn from (seed, its name), exactly, and every other tensor (each expert's too) is the file's, exactly."""
    monkeypatch.setitem(MODELS, "qwen3", (Qwen3MoeConfig, ScaledQwen3))
    losses = train_app.train(train_app.parse_args([
        "qwen3", "--init", str(runs / "hf"), "--seed", str(SEED), "--steps", "3", "--batch-size", "4", "--seq-len",
        "32", "--warmup", "1", "--device", "cpu", "--quiet", "--save-every", "0", "--out", str(runs / "run")]))
    assert f"--init: 2 tensors are not in {runs / 'hf'}; they start as their modules declare: " \
           "model.layers.*.self_attn.scale\n" in capsys.readouterr().out
    assert losses[-1] < losses[0] - 1.0
    model, files = started(runs, Parallel()), {}
    for file in (runs / "hf").glob("*.safetensors"):
        files |= load_file(file)
    for name, view in model.hf_views():
        if name.endswith("self_attn.scale"):
            generator = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
            assert torch.equal(view.detach(), 1 + torch.randn(4, generator=generator) * 0.02), name
        else:
            assert torch.equal(view.detach(), files[name]), name
    assert len(files) == sum(1 for _ in model.hf_views()) - 2


def test_every_layout_starts_from_the_same_values(runs):
    """dp 2 and ep 2 (each rank its experts) start, at --init, with every parameter equal to one process's, exactly:
    the declared scales (drawn) and the loaded weights alike."""
    one = full_values(started(runs, Parallel()))
    for rank in range(2):
        for layout, values in torch.load(runs / f"rank{rank}.pt").items():
            if layout == "bf16" or layout.endswith("grads"):
                continue
            assert set(values) == set(one)
            for name, (first, value) in values.items():
                expected = one[name][1]
                expected = expected[first:first + len(value)] if ".mlp.experts." in name else expected
                assert torch.equal(value, expected), (layout, rank, name)


def test_the_scales_own_units_reduce_their_gradients_as_one_process_computes_them(runs):
    """float32, dp 2 and ep 2 (each rank one sequence) against one process on both: each scale's gradient within 1e-5
    relative (summation order alone, seen 5.4e-7; FSDP2's sum over the ranks of the scales' unit)."""
    expected = scale_grads(started(runs, Parallel()), IDS)
    for rank in range(2):
        for layout in ("dp2", "ep2"):
            for got, want in zip(torch.load(runs / f"rank{rank}.pt")[f"{layout}-grads"], expected, strict=True):
                assert relative_error(got, want) < 1e-5 and want.abs().max() > 0, (layout, rank)


def test_a_float32_parameter_computes_in_float32_under_bf16_compute(runs):
    """bf16 compute, on one process (ComputeCasts) and on dp 2 (FSDP2, the scales a unit of their own): each forward
    computed with the fp32 master of the scale, bit for bit (values a bf16 copy would have rounded), and with q_proj's
    weight in bf16."""
    layouts = [compute_of(started(runs, Parallel(), torch.bfloat16), IDS)]
    layouts += [torch.load(runs / f"rank{rank}.pt")["bf16"] for rank in range(2)]
    for layers in layouts:
        for seen, q_dtype, master in layers:
            assert seen.dtype == torch.float32 and q_dtype == torch.bfloat16
            assert torch.equal(seen, master) and not torch.equal(master.bfloat16().float(), master)


def test_a_parameter_absent_and_not_declared_so_is_an_error_and_our_export_keeps_a_declared_one(runs, tmp_path):
    """A required parameter the files lack: the one-line error as before. Our export writes the declared-absent
    scales (the rule: exported), so loading our own folder loads them, all of them, bit for bit."""
    cfg = Qwen3MoeConfig.from_dict(read_json(runs / "hf" / "config.json"))
    required = ScaledQwen3(cfg)
    for layer in required.layers.values():
        declare(layer.self_attn, scale="normal")   # hf=True: the files must hold it
    with pytest.raises(ConfigError, match=r"^checkpoint '.*' has no tensor 'model\.layers\.0\.self_attn\.scale' "
                                          r"\(expected shape \(4,\)\)$"):
        load_hf_weights(required, runs / "hf")
    model = started(runs, Parallel())
    save_hf(model, read_json(runs / "hf" / "config.json"), tmp_path / "ours")
    again = ScaledQwen3(cfg)
    assert load_hf_weights(again, tmp_path / "ours") == []
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name
