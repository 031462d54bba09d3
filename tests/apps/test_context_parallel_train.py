"""The training app with --cp 2 (each sequence in zigzag parts over two gloo processes, ring attention), alone and
beside expert, pipeline and data parallelism, against the 1-process run on the same global batches: logged and
held-out losses, resumes between the layouts, and what it refuses with one line."""
import json

import pytest

import pith_apps.train as train_app
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.options import PRESETS
from pith_engine.parallel import LayoutError
from test_train import assert_same_scalars, tensorboard_events

# 4 sequences of 32 tokens a step (chunks of 8 at cp 2), micro-batches of one: 4 per data rank, the fewest
# DualPipeV runs at pp 2; the aux loss per sequence, the same terms under every layout
RUN = ["--batch-size", "4", "--micro-batch-size", "1", "--seq-len", "32", "--warmup", "2", "--schedule", "constant",
       "--quiet", "--save-every", "3", "--eval-every", "3", "--eval-batches", "1", "--balance", "sequence"]


def train(root, name, *flags):
    args = train_app.parse_args(["qwen3", "--config", str(root / "qwen3_4.json"), *RUN, "--out", str(root / name),
                                 *flags])
    return train_app.train(args)


def context_parallel_runs(rank, world, root):
    """cp 2: steps 1-3, then resume to 6; a --doc-mask run and a sequence length the zigzag split cannot cut
    refused with one line each."""
    losses = {"cp2": train(root, "cp2", "--cp", "2", "--steps", "3")}
    losses["cp2"] += train(root, "cp2", "--cp", "2", "--steps", "6", "--resume")
    with pytest.raises(LayoutError, match=r"^--cp=2 does not work with --doc-mask \(ring attention masks by position "):
        train(root, "doc-mask", "--cp", "2", "--doc-mask")
    with pytest.raises(LayoutError, match=r"^seq_len=30 must be divisible by 2 x cp = 4 \(each context-parallel rank "):
        train(root, "odd", "--cp", "2", "--seq-len", "30")
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(losses))


def context_beside_other_parallelism(rank, world, root):
    """cp 2 x ep 2, cp 2 x pp 2 and cp 2 x dp 2, steps 1-3."""
    losses = {f"cp2{other}2": train(root, f"cp2{other}2", "--cp", "2", f"--{other}", "2", "--steps", "3")
              for other in ("ep", "pp", "dp")}
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(losses))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel_train")
    (root / "qwen3_4.json").write_text(json.dumps(read_json(PRESETS / "qwen3_tiny.json") | {"num_hidden_layers": 4}))
    one = train(root, "one", "--steps", "6")
    run_on_processes(2, context_parallel_runs, root)
    losses = json.loads((root / "losses.json").read_text())
    run_on_processes(4, context_beside_other_parallelism, root)
    losses |= json.loads((root / "losses.json").read_text())
    losses["one"] = one
    losses["one-from-cp2"] = train(root, "one-from-cp2", "--steps", "6", "--resume-from",
                                   str(root / "cp2" / "checkpoints" / "step-00000003"))
    losses["root"] = root
    return losses


@pytest.mark.parametrize("name,steps", [("cp2", slice(0, 6)), ("one-from-cp2", slice(3, 6)), ("cp2ep2", slice(0, 3)),
                                        ("cp2pp2", slice(0, 3)), ("cp2dp2", slice(0, 3))])
def test_context_parallel_runs_and_resumes_log_the_one_process_losses(runs, name, steps):
    """cp 2 on 2 processes, cp 2 x ep 2, cp 2 x pp 2 and cp 2 x dp 2 on 4, one process resuming from cp 2; float32, the same
    terms summed in other orders: every logged loss within 1e-5 relative."""
    assert len(runs[name]) == len(range(6)[steps])
    for got, expected in zip(runs[name], runs["one"][steps]):
        assert abs(got - expected) < 1e-5 * expected, (name, got, expected)
    assert runs["one"][-1] < runs["one"][0]


def test_the_context_parallel_held_out_and_aux_losses_are_the_one_process_ones(runs):
    """TensorBoard of the cp = 2 run against the 1-process run: held-out loss at steps 3 and 6 and the aux loss of
    every step, 1e-5 relative."""
    ours, theirs = (tensorboard_events(runs["root"] / name / "tb") for name in ("cp2", "one"))
    assert_same_scalars(ours, theirs, ("eval/loss", "train/aux_loss"), 1e-5)
