"""The training app with --pp 2 (DualPipeV on gloo processes, each building only its chunks' layers), alone and
with expert or data parallelism (FSDP) beside it, against the 1-process run on the same global batches: logged
losses, held-out losses, aux losses and expert loads, resumes from each other's checkpoints, mixed precision
with an uneven user split (DeepSeek-V2's dense first layer), and the layouts it refuses."""
import json
import re

import pytest

import pith_apps.train as train_app
from distributed import run_on_processes
from hf_compare import save_tiny_hf_model
from pith_apps.config import read_json
from pith_apps.options import PRESETS
from pith_engine.dualpipev import Turns
from pith_engine.parallel import LayoutError
from test_train import assert_same_scalars, tensorboard_events

# micro-batches of one sequence, 8 per step: 4 per data rank at pp 2 x ep 2, the fewest DualPipeV runs at pp = 2
RUN = ["--batch-size", "8", "--micro-batch-size", "1", "--seq-len", "32", "--warmup", "2", "--schedule", "constant",
       "--quiet", "--save-every", "3", "--image-every", "3"]
# the aux loss per sequence: the same terms under every layout (global_batch would group each micro-batch's rows
# over the data ranks, 1 row on one process, 2 at ep = 2)
QWEN3 = ["--eval-every", "3", "--eval-batches", "1", "--balance", "sequence"]
DEEPSEEK = ["--dtype", "bfloat16", "--steps", "4"]


def write_config(root, family, layers):
    data = read_json(PRESETS / f"{family}_tiny.json") | {"num_hidden_layers": layers}
    (root / f"{family}_{layers}.json").write_text(json.dumps(data))


def train(root, name, family, layers, *flags):
    """A run from the config write_config wrote (once, before any process reads it)."""
    args = train_app.parse_args([family, "--config", str(root / f"{family}_{layers}.json"), *RUN, "--out",
                                 str(root / name), *flags])
    return train_app.train(args)


def pipeline_runs(rank, world, root):
    """pp = 2: steps 1-3, then resume to 6; from the 1-process checkpoint of step 3 to 6; DeepSeek-V2 in bf16."""
    losses = {"pp2": train(root, "pp2", "qwen3", 4, *QWEN3, "--pp", "2", "--steps", "3")}
    losses["pp2"] += train(root, "pp2", "qwen3", 4, *QWEN3, "--pp", "2", "--steps", "6", "--resume")
    losses["pp2-from-one"] = train(root, "pp2-from-one", "qwen3", 4, *QWEN3, "--pp", "2", "--steps", "6",
                                   "--resume-from", str(root / "one" / "checkpoints" / "step-00000003"))
    losses["mixed-pp2"] = train(root, "mixed-pp2", "deepseek_v2", 5, *DEEPSEEK, "--pp", "2", "--chunk-layers", "2,1,1,1")
    losses["init-pp2"] = train_app.train(train_app.parse_args(
        ["qwen3", "--init", str(root / "hf"), *RUN, "--steps", "3", "--pp", "2", "--out", str(root / "init-pp2"),
         "--export-hf", str(root / "export-pp2")]))
    with pytest.raises(LayoutError, match=r"^DualPipeV needs at least 2 x pp = 4 micro-batches per step, not 2; "):
        train(root, "too-few", "qwen3", 4, "--pp", "2", "--batch-size", "2")
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(losses))


def pipeline_beside_other_parallelism(rank, world, root):
    """pp 2 x ep 2: steps 1-3, evaluated and saved at 3, each overlapped pair's forward and backward in turns at
    their all-to-alls (counted: 3 steps, at least one pair each), then the same with --no-overlap (no turn
    passed); pp 2 x dp 2 from the pp = 2 checkpoint of step 3 to 6."""
    passes, pass_turn = [], Turns.pass_turn
    Turns.pass_turn = lambda turns: passes.append(turns.holder) or pass_turn(turns)
    losses = {"pp2ep2": train(root, "pp2ep2", "qwen3", 4, *QWEN3, "--pp", "2", "--ep", "2", "--steps", "3")}
    assert {0, 1} <= set(passes) and len(passes) >= 3 * 2, passes   # both sides passed the turn
    passes.clear()
    losses["pp2ep2-no-overlap"] = train(root, "pp2ep2-no-overlap", "qwen3", 4, *QWEN3, "--pp", "2", "--ep", "2",
                                        "--steps", "3", "--no-overlap")
    Turns.pass_turn = pass_turn
    assert passes == []
    losses["pp2dp2-from-pp2"] = train(root, "pp2dp2-from-pp2", "qwen3", 4, *QWEN3, "--pp", "2", "--dp", "2", "--steps",
                                      "6", "--resume-from", str(root / "pp2" / "checkpoints" / "step-00000003"))
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(losses))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_train")
    write_config(root, "qwen3", 4)
    write_config(root, "deepseek_v2", 5)
    import transformers
    preset = read_json(PRESETS / "qwen3_tiny.json") | {"num_hidden_layers": 4}
    save_tiny_hf_model(transformers.AutoConfig.for_model(**preset), root / "hf")
    one = train(root, "one", "qwen3", 4, *QWEN3, "--steps", "6")
    run_on_processes(2, pipeline_runs, root)
    losses = json.loads((root / "losses.json").read_text())
    run_on_processes(4, pipeline_beside_other_parallelism, root)
    losses |= json.loads((root / "losses.json").read_text())
    losses["one"] = one
    losses["one-from-pp2ep2"] = train(root, "one-from-pp2ep2", "qwen3", 4, *QWEN3, "--steps", "6", "--resume-from",
                                      str(root / "pp2ep2" / "checkpoints" / "step-00000003"))
    losses["mixed-one"] = train(root, "mixed-one", "deepseek_v2", 5, *DEEPSEEK)
    losses["init-one"] = train_app.train(train_app.parse_args(
        ["qwen3", "--init", str(root / "hf"), *RUN, "--steps", "3", "--out", str(root / "init-one"),
         "--export-hf", str(root / "export-one")]))
    losses["root"] = root
    return losses


@pytest.mark.parametrize("name,steps", [("pp2", slice(0, 6)), ("pp2-from-one", slice(3, 6)), ("pp2ep2", slice(0, 3)),
                                        ("pp2ep2-no-overlap", slice(0, 3)), ("pp2dp2-from-pp2", slice(3, 6)), ("one-from-pp2ep2", slice(3, 6))])
def test_pipelines_and_resumes_across_layouts_log_the_one_process_losses(runs, name, steps):
    """pp 2 on 2 processes, pp 2 x ep 2 (overlapped and not) and pp 2 x dp 2 (FSDP) on 4, resumes between them and one process;
    float32, the same terms summed in other orders: every logged loss within 1e-5 relative."""
    assert len(runs[name]) == len(range(6)[steps])
    for got, expected in zip(runs[name], runs["one"][steps]):
        assert abs(got - expected) < 1e-5 * expected
    assert runs["one"][-1] < runs["one"][0]


def test_the_pipelines_held_out_aux_losses_and_expert_loads_are_the_one_process_ones(runs):
    """TensorBoard of the pp = 2 run (rank 0 logs; the other rank's layers joined in) against the 1-process run:
    held-out loss at steps 3 and 6, the aux loss of every step, each MoE layer's expert-load histogram; 1e-5."""
    ours, theirs = (tensorboard_events(runs["root"] / name / "tb") for name in ("pp2", "one"))
    assert_same_scalars(ours, theirs, ("eval/loss", "train/aux_loss"), 1e-5)
    layers = [tag for tag in theirs.Tags()["histograms"] if tag.startswith("experts/load_of_layer_")]
    assert len(layers) == 4 and sorted(ours.Tags()["histograms"]) == sorted(layers)
    for tag in layers:
        for a, b in zip(ours.Histograms(tag), theirs.Histograms(tag)):
            assert a.step == b.step and abs(a.histogram_value.sum - b.histogram_value.sum) < 1e-5 * b.histogram_value.sum


def test_mixed_precision_through_an_uneven_user_split_logs_the_one_process_losses(runs):
    """DeepSeek-V2, 5 layers (the first dense) as chunks of 2, 1, 1, 1 layers, bf16 compute copies of fp32 master
    weights on each pipeline rank, as on one process: the same bf16 computations, the gradients summed in
    another order (seen 6.4e-6); 1e-4 relative."""
    assert len(runs["mixed-pp2"]) == 4
    for got, expected in zip(runs["mixed-pp2"], runs["mixed-one"]):
        assert abs(got - expected) < 1e-4 * expected


def test_init_and_export_through_the_pipeline_are_the_one_process_ones(runs):
    """--init DIR at pp = 2 (rank 0 turns the folder into a weights checkpoint, each rank loads its layers) logs
    the 1-process losses from the same folder (1e-5, float32), and --export-hf writes the tensors the 1-process
    run exports (1e-5)."""
    from safetensors.torch import load_file
    assert len(runs["init-pp2"]) == 3 and runs["init-pp2"][-1] < runs["init-pp2"][0]
    for got, expected in zip(runs["init-pp2"], runs["init-one"]):
        assert abs(got - expected) < 1e-5 * expected
    ours, theirs = ({name: t for f in (runs["root"] / folder).glob("*.safetensors") for name, t in load_file(f).items()}
                    for folder in ("export-pp2", "export-one"))
    assert set(ours) == set(theirs) and len(ours) > 20
    for name, tensor in theirs.items():
        assert (ours[name] - tensor).abs().max() <= 1e-5 * tensor.abs().max(), name


@pytest.mark.parametrize("flags, message", [
    (["--chunk-layers", "2,2"], r"^--chunk-layers='2,2' must be comma-separated layer counts \(e\.g\. 2,3,3,2\), "
                                r"with --pp > 1 \(here --pp 1\)$"),
    (["--chunk-layers", "2;2"], r"^--chunk-layers='2;2' must be comma-separated"),
    (["--pp", "2", "--no-overlap"], r"^--no-overlap is for a pipeline with expert parallelism, --pp > 1 and --ep > 1 "
                                    r"\(here --pp 2 --ep 1\)$"),
])
def test_bad_pipeline_flags_end_in_one_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        train_app.main(["qwen3", "--out", str(tmp_path / "run"), "--quiet", *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.match(message, lines[0].removeprefix("pith-train: error: ")), lines
