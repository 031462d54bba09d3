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
from pith_apps.run_log import load_figure
from test_commands import doc_command, scratch_folder

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--batch-size", "4", "--seq-len", "32", "--warmup", "2", "--device", "cpu"]


def run_script(path: str, *argv) -> str:
    done = subprocess.run([sys.executable, str(ROOT / path), *argv], capture_output=True, text=True,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run_doc_command(doc: str, script: str, folder: Path) -> str:
    """The SKILL.md's line that runs `script`, as written, from a scratch folder seeing the repository's folders."""
    env, argv = doc_command(doc, script)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=scratch_folder(folder),
                          env=os.environ | env | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_the_routing_trace_is_the_apps_run_and_its_routing(tmp_path):
    """The line of skills/pith-apps/collect-routing-trace/SKILL.md (10 steps of qwen3, tiny: 8 experts, top-2,
    weights normalized; layer 1 recorded every 5th step): the printed losses are the app's own run's (same flags, to
    the 3 printed decimals), each token's 2 experts are distinct and in range, its weights sum to 1 (within 1e-5),
    the printed busiest share is the file's, and the PNG is the load figure of 2 recorded steps."""
    out = run_doc_command("skills/pith-apps/collect-routing-trace/SKILL.md", "trace_routing.py", tmp_path)
    app = train_app.train(train_app.parse_args(["qwen3", "--steps", "10", "--batch-size", "4", "--seq-len", "32",
                                                "--device", "cpu", "--out", str(tmp_path / "run"), "--quiet",
                                                "--save-every", "0"]))
    lines = re.findall(r"step (\d+): loss ([\d.]+); busiest layer 1: expert (\d+) ([\d.]+)%", out)
    assert [int(n) for n, *_ in lines] == [5, 10]
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
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == load_figure(torch.ones(2, 8), "").size


VALIDATE = "skills/pith-apps/validate-correctness/validate.py"
SHORT = ["--", "qwen3", "--steps", "4", *TINY]


def verdict(output: str) -> tuple[str, float, float]:
    found = re.search(r"(PASS|FAIL): largest relative difference of the loss (\S+), of the gradient norm (\S+),", output)
    return found.group(1), float(found.group(2)), float(found.group(3))


@pytest.mark.parametrize("layout,family,flags", [("--dp 2", "qwen3", ["--micro-batch-size", "1"]),
                                                 ("--cp 2", "qwen3_5", [])])
def test_validate_passes_a_layout_that_computes_the_one_process_run(layout, family, flags):
    """Two processes (torchrun) against one: float32 on CPU, seen within 2.4e-7 (Qwen3.5 under cp 2, its linear
    attention's state handed from rank to rank: 4.3e-7). With micro-batches the one-process side takes
    micro-batches of all data ranks' rows (here 2), so the aux loss balances the same tokens: with micro-batches of
    1 row there, the gradient norm differed by ~1e-4. (The SKILL.md's --ep 2 and --dp 2 --pp 2 lines run in
    test_commands.py.)"""
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
    """The line of skills/pith-apps/capture-profile/SKILL.md (2 warm-up and 2 profiled steps of qwen3, tiny: 2 MoE
    layers, one micro-batch): kernels.csv heaviest first with the matmuls in it; stages.csv has the five stages,
    each called 2 layers x 2 steps times, the forward's stages a share of the wall time below 100%; the trace holds
    each stage's 4 ranges."""
    printed = run_doc_command("skills/pith-apps/capture-profile/SKILL.md", "profile_steps.py", tmp_path)
    out = tmp_path / "prof"
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
    """The template's test, run by the line of skills/pith-ops/add-kernel/SKILL.md (6 cases under the interpreter on
    CPU), passes; the same command on a copy whose forward kernel forgets the scale fails."""
    env, argv = doc_command("skills/pith-ops/add-kernel/SKILL.md", "tests_template.py")
    env = os.environ | env | {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    good = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=scratch_folder(tmp_path))
    assert good.returncode == 0 and "6 passed" in good.stdout, good.stdout[-2000:]
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("kernel_template.py", "tests_template.py"):
        shutil.copy(ROOT / "skills/pith-ops/add-kernel" / name, copy / name)
    kernel = copy / "kernel_template.py"
    kernel.write_text(kernel.read_text().replace("(x * s[:, None]).to(out_ptr", "x.to(out_ptr"))
    broken = subprocess.run([*argv[:-1], str(copy / "tests_template.py")], capture_output=True, text=True, env=env,
                            cwd=copy)
    assert broken.returncode == 1 and "failed" in broken.stdout


def test_the_parity_template_passes_on_each_family_and_catches_a_wrong_model(tmp_path):
    """The line of skills/pith-apps/add-new-model/SKILL.md runs the template (qwen3): 1 passed; the same command on
    copies set to the other two families passes, on a copy whose model has its final norm's weight moved by 1%
    after loading fails."""
    env, argv = doc_command("skills/pith-apps/add-new-model/SKILL.md", "parity_template.py")
    template = (ROOT / "skills/pith-apps/add-new-model/parity_template.py").read_text()
    folder = ROOT / "skills/pith-apps/add-new-model"   # the copies sit beside it: it finds tests/ from there
    variants = {f"parity_{family}.py": template.replace('FAMILY = "qwen3"', f'FAMILY = "{family}"')
                for family in ("deepseek_v2", "gpt_oss")}
    variants["parity_wrong.py"] = template.replace("    theirs, mine =", "    ours.model.norm.weight.data.mul_(1.01)\n"
                                                   "    theirs, mine =")
    try:
        for name, text in variants.items():
            (folder / name).write_text(text)
        done = subprocess.run([*argv, *(str(folder / name) for name in variants), "-p", "no:cacheprovider"],
                              capture_output=True, text=True, cwd=ROOT, env=os.environ | env)
    finally:
        for name in variants:
            (folder / name).unlink(missing_ok=True)
    assert "3 passed" in done.stdout and "1 failed" in done.stdout and "parity_wrong.py" in done.stdout, done.stdout


def test_the_routing_template_passes_and_catches_a_wrong_router():
    """The line of skills/pith-apps/add-routing-variant/SKILL.md runs the template: 4 passed (the limit, the hand
    case, training through the app, ep 2 and cp 2 against one process); a copy whose rule keeps a slot when the
    scores before it reach p exactly (<= for <) fails the hand case."""
    env, argv = doc_command("skills/pith-apps/add-routing-variant/SKILL.md", "routing_template.py")
    folder = ROOT / "skills/pith-apps/add-routing-variant"
    done = subprocess.run([*argv, "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | env)
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:]
    wrong = folder / "routing_wrong.py"
    try:
        wrong.write_text((folder / "routing_template.py").read_text().replace("before < p", "before <= p"))
        broken = subprocess.run([*argv[:-1], str(wrong), "-k", "hand", "-p", "no:cacheprovider"], capture_output=True,
                                text=True, cwd=ROOT, env=os.environ | env)
    finally:
        wrong.unlink(missing_ok=True)
    assert broken.returncode == 1 and "1 failed" in broken.stdout, broken.stdout[-3000:]


def test_the_attention_template_passes_and_catches_a_wrong_variant(tmp_path):
    """The line of skills/pith-apps/add-attention-variant/SKILL.md runs the template: 4 passed (t = 0 against the
    unmodified model, the hand case, training through the app, cp 2 against one process); a copy (in a scratch folder
    that sees tests/) whose queries are scaled by 1 + t instead of exp(t) fails its hand case."""
    env, argv = doc_command("skills/pith-apps/add-attention-variant/SKILL.md", "attention_template.py")
    done = subprocess.run([*argv, "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | env)
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:]
    copy = scratch_folder(tmp_path) / "copy/pith-apps/add-attention-variant/attention_wrong.py"   # tests/: parents[3]
    copy.parent.mkdir(parents=True)
    template = (ROOT / "skills/pith-apps/add-attention-variant/attention_template.py").read_text()
    copy.write_text(template.replace("q * self.temperature.exp()", "q * (1 + self.temperature)"))
    broken = subprocess.run([*argv[:-1], str(copy), "-k", "tiny_case", "-p", "no:cacheprovider"], capture_output=True,
                            text=True, cwd=tmp_path, env=os.environ | env)
    assert broken.returncode == 1 and "1 failed" in broken.stdout, broken.stdout[-3000:]
