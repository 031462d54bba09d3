"""Opt-in (PITH_SLOW=1; its time in docs/testing.md): the first cluster run, rehearsed on CPU. 8 gloo processes under
torchrun, for Qwen3-MoE and DeepSeek-V2 models of about 200 MB of fp32 weights (64 experts), at --pp 2 --ep 4,
--dp 2 --ep 4 and --dp 8 --dp-replicate 2: --init from a Hugging Face folder, steps with evaluations and checkpoints,
kill -9 of one rank once the step-4 checkpoint is written, --resume to the end with --export-hf. Each rank's peak
memory (RSS) is measured and printed with the time from the launch to the first step (docs/testing.md records
them). The resumed runs log the one-process run's losses (1e-4 relative: summation order), their exports load in transformers with the logits of
their last checkpoint and hold pith-convert's tensors of it exactly."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import pith_apps.train as train_app
from conftest import relative_error
from distributed import free_port
from pith_apps import convert
from pith_apps.config import read_json
from pith_apps.hf_checkpoint import save_hf
from pith_apps.options import MODELS, PRESETS
from pith_engine import checkpoint
from pith_engine.parallel import Parallel
from test_waits import gone, workers_of

WIDE = {"qwen3": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, head_dim=64, moe_intermediate_size=256,
                      num_experts=64),
        "deepseek_v2": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, moe_intermediate_size=256,
                            n_routed_experts=64, intermediate_size=1024)}
# each micro-batch 8 rows of the global batch under every layout (the aux losses' unit): as the one process's
LAYOUTS = {"pp2-ep4": ["--pp", "2", "--ep", "4", "--micro-batch-size", "2"],
           "dp2-ep4": ["--dp", "2", "--ep", "4", "--micro-batch-size", "1"],
           "dp8-hsdp2": ["--dp", "8", "--dp-replicate", "2", "--micro-batch-size", "1"]}
RUN = ["--batch-size", "32", "--seq-len", "32", "--device", "cpu", "--save-every", "2",
       "--eval-every", "2", "--eval-batches", "1", "--warmup", "2", "--schedule", "constant", "--steps", "6",
       "--dist-timeout", "300"]
slow = pytest.mark.skipif(os.environ.get("PITH_SLOW") != "1", reason="opt-in: PITH_SLOW=1 (15 launches of 8 processes)")


def launch(out, flags, kill_after=None) -> dict:
    """torchrun with 8 workers of the app with these flags; each rank's peak RSS (polled); kill_after: once this
    checkpoint is `latest`, kill -9 rank 3. -> returncode, stdout, stderr, peaks {rank: bytes}, start (time.time())."""
    start, peaks = time.time(), {}
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "--master-port",
                                str(free_port()), "-m", "pith_apps.train", *flags, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    killed = threading.Event()

    def watch():
        while process.poll() is None:
            for rank, pid in workers_of(process.pid).items():
                try:
                    status = open(f"/proc/{pid}/status").read()
                    peaks[rank] = max(peaks.get(rank, 0), int(status.split("VmHWM:")[1].split()[0]) * 1024)
                except (OSError, IndexError):
                    pass
            latest = out / "checkpoints" / "latest"
            if kill_after and not killed.is_set() and latest.is_file() and latest.read_text().strip() == kill_after:
                os.kill(workers_of(process.pid)[3], signal.SIGKILL)
                killed.set()
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        stdout, stderr = process.communicate(timeout=900)
    finally:
        process.kill()
        watcher.join()
    return dict(returncode=process.returncode, stdout=stdout, stderr=stderr, peaks=peaks, start=start,
                killed=killed.is_set())


def tb_losses(out) -> tuple[dict, float]:
    """{step: the loss logged last for it} and the wall time of step 1's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Scalars("train/loss")
    return {e.step: e.value for e in scalars}, min(e.wall_time for e in scalars if e.step == 1)


@pytest.fixture(scope="module", params=sorted(WIDE))
def family_folder(request, tmp_path_factory):
    """The family's wide Hugging Face folder (random weights) and the one-process run's losses from it."""
    family, root = request.param, tmp_path_factory.mktemp(f"rehearsal_{request.param}")
    data = read_json(PRESETS / f"{family}_tiny.json") | WIDE[family]
    config_cls, model_cls = MODELS[family]
    model = model_cls(config_cls.from_dict(data), Parallel())
    model.init_weights(seed=7)
    save_hf(model, data, root / "hf")
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    del model
    one = train_app.train(train_app.parse_args([family, "--init", str(root / "hf"), *RUN, "--micro-batch-size", "8",
                                                "--quiet", "--out",
                                                str(root / "one")]))
    return family, root, one, fp32_bytes


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """{layout: each rank's peak RSS in a run of the tiny preset}: what a rank takes beside its part of the model."""
    root, found = tmp_path_factory.mktemp("rehearsal_bare"), {}

    def peaks(layout):
        if layout not in found:
            run = launch(root / layout, ["qwen3", *RUN, *LAYOUTS[layout], "--layers", "4", "--steps", "2", "--quiet"])
            assert run["returncode"] == 0, run["stderr"][-3000:]
            found[layout] = run["peaks"]
        return found[layout]
    return peaks


@slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_first_cluster_run_rehearsed_on_eight_processes(family_folder, bare, layout, capsys):
    """Each rank's peak RSS is measured (polled) and printed above a run of the tiny preset at the same layout: a
    record, not a bound (the bound on loading and exporting is tests/apps/test_hf_per_rank.py's)."""
    family, root, one, fp32_bytes = family_folder
    out, export = root / layout, root / f"{layout}-export"
    flags = [family, "--init", str(root / "hf"), *RUN, *LAYOUTS[layout]]
    first = launch(out, [*flags, "--quiet"], kill_after="step-00000004")
    assert first["killed"] and first["returncode"] != 0, first["stderr"][-3000:]
    second = launch(out, [*flags, "--resume", "--export-hf", str(export)])
    assert second["returncode"] == 0 and f"exported the model to {export}" in second["stdout"], second["stderr"][-3000:]
    losses, first_step = tb_losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step, expected in enumerate(one, 1):
        assert abs(losses[step] - expected) < 1e-4 * expected, (step, losses[step], expected)
    # the export: transformers' logits of the last checkpoint's weights, pith-convert's tensors of it exactly
    import transformers
    from safetensors.torch import load_file
    last = out / "checkpoints" / "step-00000006"
    data = read_json(root / "hf" / "config.json")
    config_cls, model_cls = MODELS[family]
    ours = model_cls(config_cls.from_dict(data), Parallel())
    checkpoint.load_weights(last, ours)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(theirs(input_ids=ids).logits, ours(ids)) < 1e-4
    convert.main([str(last), str(root / f"{layout}-converted")])
    exported = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}
    converted = {k: v for f in sorted((root / f"{layout}-converted").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(converted) and all(torch.equal(exported[k], converted[k]) for k in exported)
    to_step_1 = first_step - first["start"]   # (the resumed run keeps the first run's steps 1-4 in its logs)
    tiny = bare(layout)
    grown = {name: [(run["peaks"][r] - tiny[r]) / 2**20 for r in range(8)] for name, run in
             (("first run", first), ("resumed with the export", second))}
    with capsys.disabled():
        print(f"\n{family} {layout} ({fp32_bytes / 2**20:.0f} MiB of fp32 weights): launch to step 1 {to_step_1:.1f} s; "
              f"peak RSS per rank above the tiny run's ({min(tiny.values()) / 2**20:.0f}-"
              f"{max(tiny.values()) / 2**20:.0f} MiB), MiB: " + "; ".join(
                  f"{name} " + " ".join(f"{g:.0f}" for g in growth) for name, growth in grown.items()))
