"""The app's --optimizer muon: which parameters each family gives Muon and which AdamW, its flags (and their TOML
file), resumes that repeat the uninterrupted run (one process's checkpoint under dp 2, ep 2 and dp 2 x ep 2, dp 2's on
one process), and the same steps under dp 2, ep 2, dp 2 x ep 2, pp 2, cp 2 and HSDP (2 replicas of 2 shards) as on
one process (spawned gloo processes, the app's own train(): logged losses and gradient norms)."""
import json
import math
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import pith_apps.train as train_app
from distributed import run_on_processes
from pith_apps.config import ConfigError
from pith_apps.options import MODELS, parse_args, run_config_text
from pith_apps.run_folder import RunFolder
from pith_engine import checkpoint
import pith_engine.muon as muon_module
from pith_engine.muon import Muon
from pith_engine.parallel import Parallel
from test_train import tensorboard_events

MUON = {
    "qwen3": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "deepseek_v2": ["self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight",
                    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                    "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.shared_experts.gate_proj.weight",
                    "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"],
    "gpt_oss": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "qwen3_5": ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                "linear_attn.in_proj_a.weight", "linear_attn.out_proj.weight", "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                "mlp.shared_expert.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight", "self_attn.o_proj.weight"],
}
OUTSIDE_LAYERS = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
ADAMW = {
    "qwen3": ["input_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
              "post_attention_layernorm.weight", "mlp.gate.weight"],
    "deepseek_v2": ["input_layernorm.weight", "self_attn.kv_a_layernorm.weight", "post_attention_layernorm.weight",
                    "mlp.gate.weight"],
    "gpt_oss": ["input_layernorm.weight", "self_attn.sinks", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                "self_attn.v_proj.bias", "self_attn.o_proj.bias", "post_attention_layernorm.weight", "mlp.router.weight",
                "mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"],
    "qwen3_5": ["input_layernorm.weight", "linear_attn.dt_bias", "linear_attn.A_log", "linear_attn.conv1d.weight",
                "linear_attn.norm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
                "mlp.shared_expert_gate.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"],
}


def layer_kind(name: str) -> str:
    """A parameter's name with its layer number left out: model.layers.N.<rest> -> <rest>."""
    return re.sub(r"^model\.layers\.\d+\.", "", name)


@pytest.mark.parametrize("family", list(MODELS))
def test_each_family_gives_muon_its_hidden_matrices_and_adamw_the_rest(family):
    """The tiny preset through the app's prepare_step under --optimizer muon: Muon's groups hold exactly the listed
    matrices of every layer (each a batch of matrices: 2-d, or an expert stack [experts, rows, columns]), decayed,
    the experts' gate_up_proj in the group that splits their rows (not GPT-OSS's); AdamW's two groups the rest."""
    args = parse_args([family, "--optimizer", "muon", "--weight-decay", "0.1"])
    model = MODELS[family][1](train_app.model_config(args), Parallel())
    optimizer, graph = train_app.prepare_step(args, Parallel(), torch.device("cpu"), model)
    assert isinstance(optimizer, Muon) and graph is None
    names = {id(p): name for name, p in model.named_parameters()}
    muon_groups = [group for group in optimizer.param_groups if group.get("muon")]
    adamw_groups = optimizer.param_groups[len(muon_groups):]
    for group in muon_groups:
        assert (group["weight_decay"], group["momentum"], group["nesterov"], group["ns_steps"]) == (0.1, 0.95, True, 5)
    # the experts' gate and up halves orthogonalized apart, where the Hugging Face files hold them apart (not
    # GPT-OSS's, one tensor there)
    halves = [layer_kind(names[id(p)]) for group in muon_groups if group["split"] == "halves" for p in group["params"]]
    assert set(halves) == (set() if family == "gpt_oss" else {"mlp.experts.gate_up_proj"})
    assert [group["split"] for group in muon_groups] == ["whole"] + ([] if family == "gpt_oss" else ["halves"])
    on_muon = [names[id(p)] for group in muon_groups for p in group["params"]]
    on_adamw = [names[id(p)] for group in adamw_groups for p in group["params"]]
    assert sorted(set(map(layer_kind, on_muon))) == sorted(MUON[family])
    assert sorted(set(map(layer_kind, on_adamw))) == sorted(ADAMW[family] + OUTSIDE_LAYERS)
    assert len(on_muon) + len(on_adamw) == len(names)   # each parameter in one group
    assert all(model.get_parameter(name).ndim in (2, 3) for name in on_muon)


def test_the_flags_their_defaults_checks_and_toml_file(tmp_path):
    defaults = parse_args(["qwen3"])
    assert (defaults.optimizer, defaults.muon_momentum, defaults.nesterov, defaults.ns_steps) == ("adamw", 0.95, True, 5)
    args = parse_args(["qwen3", "--optimizer", "muon", "--muon-momentum", "0.9", "--no-nesterov", "--ns-steps", "3"])
    text = run_config_text(args)
    for line in ('optimizer = "muon"', "muon-momentum = 0.9", "nesterov = false", "ns-steps = 3"):
        assert line in text.splitlines(), line
    (tmp_path / "run.toml").write_text(text)
    assert vars(parse_args(["--run-config", str(tmp_path / "run.toml")])) == vars(args) | {
        "run_config": str(tmp_path / "run.toml")}
    for flags, message in ((["--muon-momentum", "1"], r"--muon-momentum=1.0 must be in \[0, 1\)"),
                           (["--ns-steps", "0"], r"--ns-steps=0 must be a positive integer")):
        with pytest.raises(ConfigError, match=message):
            train_app.check_args(parse_args(["qwen3", "--optimizer", "muon", *flags]))


# constant LR after warmup, so that a run stopped at step 3 and resumed to 6 has the schedule of a 6-step run;
# 4 layers (pp 2's 4 chunks), micro-batches of one sequence (4 per data rank: DualPipeV's fewest at pp 2), the aux
# loss per sequence (the same terms under every layout), sequences cp 2 can cut in zigzag chunks
RUN = ["qwen3", "--optimizer", "muon", "--layers", "4", "--batch-size", "4", "--micro-batch-size", "1", "--seq-len",
       "32", "--warmup", "2", "--schedule", "constant", "--balance", "sequence", "--quiet", "--save-every", "3"]


def train(out, steps, *flags):
    return train_app.train(train_app.parse_args([*RUN, "--out", str(out), "--steps", str(steps), *flags]))


def noting_checkpoint_bytes(noted: dict, patch: pytest.MonkeyPatch):
    """RunFolder.check_space notes the size it is given (pith_apps.run_folder.checkpoint_bytes) under the run folder's name."""
    check = RunFolder.check_space
    patch.setattr(RunFolder, "check_space", lambda self, size, *rest: noted.update({self.out.name: size}) or check(
        self, size, *rest))


def at_step_3(run, copy):
    """A copy of `run` (the one-process run) as its checkpoint of step 3 left it."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-00000006")
    (copy / "checkpoints" / "latest").write_text("step-00000003")


def two_process_runs(rank, world, root):
    """Each layout's 3 steps; under dp 2 each rank's count of the matrices it orthogonalized; steps 4-6 from the
    one-process checkpoint of step 3 under dp 2 and ep 2."""
    noted = {}
    noting_checkpoint_bytes(noted, pytest.MonkeyPatch())   # (this spawned process ends with the test)
    counts, orthogonalize = [], muon_module.orthogonalize
    muon_module.orthogonalize = lambda update, *args: counts.append(update[..., 0, 0].numel()) or orthogonalize(
        update, *args)
    losses = {"dp2": train(root / "dp2", 3, "--dp", "2")}
    muon_module.orthogonalize = orthogonalize
    losses |= {f"{dim}2": train(root / f"{dim}2", 3, f"--{dim}", "2") for dim in ("ep", "pp", "cp")}
    losses |= {f"one-then-{dim}2": train(root / f"one-then-{dim}2", 6, f"--{dim}", "2", "--resume")
               for dim in ("dp", "ep")}
    every = [None] * world
    dist.all_gather_object(every, sum(counts))
    if rank == 0:
        (root / "losses-2.json").write_text(json.dumps(losses | {"dp2-counts": every, "sizes": noted}))


def four_process_runs(rank, world, root):
    noted = {}
    noting_checkpoint_bytes(noted, pytest.MonkeyPatch())
    losses = {"dp2-ep2": train(root / "dp2-ep2", 3, "--dp", "2", "--ep", "2"),
              "hsdp": train(root / "hsdp", 3, "--dp", "4", "--dp-replicate", "2"),   # 2 replicas of 2 shards
              "one-then-dp2-ep2": train(root / "one-then-dp2-ep2", 6, "--dp", "2", "--ep", "2", "--resume")}
    if rank == 0:
        (root / "losses-4.json").write_text(json.dumps(losses | {"sizes": noted}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process's 6 steps; steps 1-3 under each layout; from the one-process checkpoint of step 3 to 6 under dp 2,
    ep 2 and dp 2 x ep 2; from the dp 2 checkpoint of step 3 on one process to 6."""
    root = tmp_path_factory.mktemp("muon_train")
    noted = {}
    with pytest.MonkeyPatch.context() as patch:
        noting_checkpoint_bytes(noted, patch)
        losses = {"one": train(root / "one", 6)}
    for name in ("one-then-dp2", "one-then-ep2", "one-then-dp2-ep2"):
        at_step_3(root / "one", root / name)
    run_on_processes(2, two_process_runs, root)
    run_on_processes(4, four_process_runs, root)
    two, four = (json.loads((root / f"losses-{n}.json").read_text()) for n in (2, 4))
    losses |= two | four | {"sizes": noted | two["sizes"] | four["sizes"]}
    shutil.copytree(root / "dp2", root / "dp2-then-one")
    losses["dp2-then-one"] = train(root / "dp2-then-one", 6, "--resume")
    return root, losses


def grad_norms(folder) -> list[float]:
    return [event.value for event in tensorboard_events(folder / "tb").Scalars("train/grad_norm")]


@pytest.mark.parametrize("name", ["dp2", "ep2", "dp2-ep2", "pp2", "cp2", "hsdp"])
def test_each_layout_takes_the_one_process_muon_steps(runs, name):
    """Float32: the logged loss of each of the 3 steps (the 2nd and 3rd after Muon's updates) and each clipped
    gradient norm within 1e-5 of one process's, the layouts differing in summation order only."""
    root, losses = runs
    ours, one = losses[name], losses["one"][:3]
    assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, one)), (ours, one)
    norms, reference = grad_norms(root / name), grad_norms(root / "one")[:3]
    assert len(norms) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, reference)), (norms, reference)
    assert one[2] < one[0]


def test_under_dp2_each_rank_orthogonalizes_its_share_of_the_matrices(runs):
    """4 layers of 4 attention projections and 8 experts' 2 matrices: 80 matrices a step, each orthogonalized by one
    of the 2 ranks (its whole matrix, dealt by NS cost), 240 over 3 steps; each rank did between 40% and 60%."""
    _, losses = runs
    counts = losses["dp2-counts"]
    assert sum(counts) == 3 * 4 * (4 + 8 * 2) and all(0.4 * 240 <= count <= 0.6 * 240 for count in counts), counts


def test_a_dp2_checkpoint_resumes_on_one_process_as_the_uninterrupted_run(runs):
    """Steps 4-6 on one process from the dp 2 checkpoint of step 3 (its momentum buffers and AdamW moments
    gathered from the two ranks' shards): the one-process run's losses within 1e-5."""
    _, losses = runs
    ours, one = losses["dp2-then-one"], losses["one"][3:]
    assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, one)), (ours, one)


@pytest.mark.parametrize("layout", ["dp2", "ep2", "dp2-ep2"])
def test_a_one_process_checkpoint_resumes_under_a_layout_as_the_uninterrupted_run(runs, layout):
    """Steps 4-6 under dp 2, ep 2 and dp 2 x ep 2 from the one-process checkpoint of step 3 (each rank loading its
    shard of every momentum buffer and AdamW moment, its experts' under ep, Muon's matrices then dealt out over their
    shard groups): the one-process run's losses within 1e-5, as the layouts' own steps are."""
    _, losses = runs
    ours, one = losses[f"one-then-{layout}"], losses["one"][3:]
    assert len(ours) == 3 and all(abs(a - b) <= 1e-5 * b for a, b in zip(ours, one)), (ours, one)


def test_a_resume_repeats_the_uninterrupted_run_exactly_and_the_checkpoint_holds_muons_state(runs, tmp_path):
    """One process, steps 4-6 from the step-3 checkpoint of the 6-step run: every loss and weight exactly the
    uninterrupted run's. The checkpoint holds each Muon matrix's momentum (one entry per expert) and AdamW's moments
    for the rest, no moments for Muon's; an AdamW run is not resumed from it."""
    root, losses = runs
    at_step_3(root / "one", tmp_path / "run")
    assert train(tmp_path / "run", 6, "--resume") == losses["one"][3:]
    saved = dcp.FileSystemReader(root / "one" / "checkpoints" / "step-00000006").read_metadata().state_dict_metadata
    resumed = dcp.FileSystemReader(tmp_path / "run" / "checkpoints" / "step-00000006").read_metadata().state_dict_metadata
    assert saved.keys() == resumed.keys()
    args = train_app.parse_args(RUN)
    uninterrupted, repeated = (MODELS["qwen3"][1](train_app.model_config(args), Parallel()) for _ in range(2))
    checkpoint.load_weights(root / "one" / "checkpoints" / "step-00000006", uninterrupted)
    checkpoint.load_weights(tmp_path / "run" / "checkpoints" / "step-00000006", repeated)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted.parameters(), repeated.parameters()))
    for name in ("optimizer.model.layers.1.mlp.experts.7.down_proj.momentum_buffer",
                 "optimizer.model.layers.0.self_attn.q_proj.weight.momentum_buffer",
                 "optimizer.lm_head.weight.exp_avg", "optimizer.model.layers.0.mlp.gate.weight.exp_avg_sq"):
        assert name in saved, name
    assert not any(name.endswith("q_proj.weight.exp_avg") or "experts.0.down_proj.exp_avg" in name for name in saved)
    with pytest.raises(ConfigError, match=r"was trained with --optimizer muon, not adamw: resume with it"):
        train_app.train(train_app.parse_args([*RUN, "--optimizer", "adamw", "--out", str(tmp_path / "run"), "--steps",
                                              "7", "--resume"]))


def saved_bytes(run) -> tuple[int, int]:
    """(the bytes of the tensors the step-3 checkpoint of run holds, by its .metadata; the bytes of its files)."""
    folder = run / "checkpoints" / "step-00000003"
    entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata.values()
    return (sum(math.prod(entry.size) * entry.properties.dtype.itemsize for entry in entries),
            sum(file.stat().st_size for file in folder.iterdir()))


def check_room(estimated: int, run):
    """Within 0.2% above the tensors saved (each rank counts its copy of the 5 KB RNG state and the step) and within
    10% below the files on disk (seen 3.2-9.1% below: DCP's serialization of each rank's shards and its .metadata, a
    share that shrinks as the tensors grow)."""
    tensors, files = saved_bytes(run)
    assert tensors <= estimated <= 1.002 * tensors and 0.9 * files <= estimated <= files, (estimated, tensors, files)


@pytest.mark.parametrize("name", ["one", "dp2", "ep2", "dp2-ep2", "pp2", "cp2", "hsdp"])
def test_the_room_a_run_checks_for_a_checkpoint_is_the_checkpoints_size(runs, name):
    """checkpoint_bytes, which RunFolder.check_space is given, against each layout's step-3 checkpoint as
    check_room: Muon's momentum one fp32 tensor of each of its matrices where AdamW keeps two (counted as AdamW's, the
    estimate would be 38% over), each element once under every layout, HSDP's 2 replicas too."""
    root, losses = runs
    check_room(losses["sizes"][name], root / name)


def test_the_room_checked_for_an_adamw_checkpoint_counts_its_two_moments(tmp_path, monkeypatch):
    """The same run's 3 steps under --optimizer adamw, as check_room."""
    noted = {}
    noting_checkpoint_bytes(noted, monkeypatch)
    train(tmp_path / "adamw", 3, "--optimizer", "adamw")
    check_room(noted["adamw"], tmp_path / "adamw")
