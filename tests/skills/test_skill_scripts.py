"""Each skill's script run as a user runs it (a process of its own) on a tiny CPU config, its output checked."""
import csv
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pith_apps.train as train_app

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--batch-size", "4", "--seq-len", "32", "--warmup", "2", "--device", "cpu"]


def run_script(path: str, *argv) -> str:
    done = subprocess.run([sys.executable, str(ROOT / path), *argv], capture_output=True, text=True,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_routing_trace_is_the_apps_run_and_its_routing(tmp_path):
    """6 steps of qwen3 (tiny: 8 experts, top-2, weights normalized), layer 1 recorded every 3rd step: the printed
    losses are the app's own run's (same flags, to the 3 printed decimals), each token's 2 experts are distinct
    and in range, its weights sum to 1 (within 1e-5), the printed busiest share is the file's, and the PNG is
    8 pixels per cell."""
    out = run_script("skills/pith-apps/collect-routing-trace/trace_routing.py", "--out", str(tmp_path / "trace"),
                     "--layers", "1", "--every", "3", "--", "qwen3", "--steps", "6", *TINY)
    app = train_app.train(train_app.parse_args(["qwen3", "--steps", "6", *TINY, "--out", str(tmp_path / "run"),
                                                "--quiet", "--save-every", "0"]))
    lines = re.findall(r"step (\d+): loss ([\d.]+); busiest layer 1: expert (\d+) ([\d.]+)%", out)
    assert [int(n) for n, *_ in lines] == [3, 6]
    for number, loss, expert, share in lines:
        assert f"{app[int(number) - 1]:.3f}" == loss
        trace = load_file(tmp_path / "trace" / f"step-{int(number):08d}.safetensors")
        ids, weights = trace["layer.1.expert_ids"], trace["layer.1.weights"]
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == weights.shape == (4 * 32, 2)
        assert bool((ids >= 0).all() and (ids < 8).all() and (ids[:, 0] != ids[:, 1]).all())
        assert torch.allclose(weights.sum(1), torch.ones(4 * 32), atol=1e-5)
        load = torch.bincount(ids.flatten().long(), minlength=8)
        assert int(load.argmax()) == int(expert) and f"{100 * load.max() / load.sum():.1f}" == share
    png = (tmp_path / "trace" / "load-layer-1.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (8 * 8, 2 * 8)


VALIDATE = "skills/pith-apps/validate-correctness/validate.py"
SHORT = ["--", "qwen3", "--steps", "4", *TINY]


def verdict(output: str) -> tuple[str, float, float]:
    found = re.search(r"(PASS|FAIL): largest relative difference of the loss (\S+), of the gradient norm (\S+),", output)
    return found.group(1), float(found.group(2)), float(found.group(3))


@pytest.mark.parametrize("layout,family,flags", [("--ep 2", "qwen3", []), ("--dp 2", "qwen3", ["--micro-batch-size", "1"]),
                                                 ("--cp 2", "qwen3_5", [])])
def test_validate_passes_a_layout_that_computes_the_one_process_run(layout, family, flags):
    """Two processes (torchrun) against one: float32 on CPU, seen within 2.4e-7 (Qwen3.5 under cp 2, its linear
    attention's state handed from rank to rank: 4.3e-7). With micro-batches the one-process side takes
    micro-batches of all data ranks' rows (here 2), so the aux loss balances the same tokens: with micro-batches of
    1 row there, the gradient norm differed by ~1e-4."""
    result, loss, grad = verdict(run_script(VALIDATE, "--layout", layout, "--", family, "--steps", "4", *TINY, *flags))
    assert result == "PASS" and loss < 1e-5 and grad < 1e-5


def test_validate_passes_the_same_code_and_fails_a_change_against_a_git_revision(tmp_path):
    """A git repository holding a copy of the packages and the script: against HEAD, the unchanged tree gives the
    same numbers exactly; after RMSNorm's epsilon is changed in the working tree, the same command fails (exit 1)."""
    repo = tmp_path / "repo"
    for part in ("packages", "skills/pith-apps/validate-correctness"):
        shutil.copytree(ROOT / part, repo / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    git = ["git", "-C", str(repo), "-c", "user.email=ci@pith", "-c", "user.name=ci"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "main"]):
        subprocess.run(git + command, check=True, capture_output=True)
    script = repo / VALIDATE
    same = subprocess.run([sys.executable, str(script), "--against", "HEAD", *SHORT], capture_output=True, text=True)
    assert same.returncode == 0 and verdict(same.stdout) == ("PASS", 0.0, 0.0), same.stdout + same.stderr
    layers = repo / "packages/pith-apps/src/pith_apps/models/layers.py"
    layers.write_text(layers.read_text().replace("x32.pow(2).mean(-1, keepdim=True) + self.eps",
                                                 "x32.pow(2).mean(-1, keepdim=True) + self.eps + 1e-2"))
    changed = subprocess.run([sys.executable, str(script), "--against", "HEAD", *SHORT], capture_output=True, text=True)
    result, loss, grad = verdict(changed.stdout)
    assert changed.returncode == 1 and result == "FAIL" and max(loss, grad) > 1e-4, changed.stdout


def test_the_profile_has_its_trace_kernels_and_five_stages(tmp_path):
    """2 warm-up and 2 profiled steps of qwen3 (tiny: 2 MoE layers, one micro-batch): kernels.csv heaviest first
    with the matmuls in it; stages.csv has the five stages, each called 2 layers x 2 steps times, the forward's
    stages a share of the wall time below 100%; the trace holds each stage's 4 ranges."""
    out = tmp_path / "prof"
    printed = run_script("skills/pith-apps/capture-profile/profile_steps.py", "--out", str(out), "--", "qwen3", *TINY)
    kernels = list(csv.DictReader((out / "kernels.csv").open()))
    totals = [float(row["total_time_ms"]) for row in kernels]
    assert totals == sorted(totals, reverse=True) and totals[0] > 0
    assert any(row["kernel_name"] == "aten::mm" and int(row["instances"]) > 0 for row in kernels)
    stages = list(csv.DictReader((out / "stages.csv").open()))
    assert [row["stage"] for row in stages] == ["1 attention_stage", "2 dispatch", "3 expert_stage", "4 combine",
                                                "5 aggregate_stage"]
    assert all(int(row["calls"]) == 4 for row in stages) and 0 < sum(float(r["share_pct"]) for r in stages) < 100
    assert float(stages[0]["total_time_ms"]) > 0 and float(stages[2]["total_time_ms"]) > 0
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert sum(event.get("name") == "stage 3 expert_stage" for event in events) == 4
    assert "forward time per MoE stage" in printed


def test_the_kernel_template_passes_its_test_and_the_test_catches_a_wrong_kernel(tmp_path):
    """The add-kernel template's test, run as the SKILL.md says (6 cases under the interpreter on CPU), passes;
    a copy whose forward kernel forgets the scale fails it."""
    template = ROOT / "skills/pith-ops/add-kernel"
    env = os.environ | {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    good = subprocess.run([*command, str(template / "tests_template.py")], capture_output=True, text=True, env=env)
    assert good.returncode == 0 and "6 passed" in good.stdout, good.stdout[-2000:]
    for name in ("kernel_template.py", "tests_template.py"):
        shutil.copy(template / name, tmp_path / name)
    kernel = tmp_path / "kernel_template.py"
    kernel.write_text(kernel.read_text().replace("(x * s[:, None]).to(out_ptr", "x.to(out_ptr"))
    broken = subprocess.run([*command, str(tmp_path / "tests_template.py")], capture_output=True, text=True, env=env)
    assert broken.returncode == 1 and "failed" in broken.stdout


def test_the_parity_template_passes_on_each_family_and_catches_a_wrong_model(tmp_path):
    """The add-new-model template run as the SKILL.md says, set to each of the three families: passes; a copy whose
    model has its final norm's weight moved by 1% after loading fails."""
    template = (ROOT / "skills/pith-apps/add-new-model/parity_template.py").read_text()
    folder = ROOT / "skills/pith-apps/add-new-model"   # the copies sit beside it: it finds tests/ from there
    variants = {f"parity_{family}.py": template.replace('FAMILY = "qwen3"', f'FAMILY = "{family}"')
                for family in ("qwen3", "deepseek_v2", "gpt_oss")}
    variants["parity_wrong.py"] = template.replace("    theirs, mine =", "    ours.model.norm.weight.data.mul_(1.01)\n"
                                                   "    theirs, mine =")
    try:
        for name, text in variants.items():
            (folder / name).write_text(text)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *(str(folder / name) for name in variants)], capture_output=True, text=True)
    finally:
        for name in variants:
            (folder / name).unlink(missing_ok=True)
    assert "3 passed" in done.stdout and "1 failed" in done.stdout and "parity_wrong.py" in done.stdout, done.stdout
