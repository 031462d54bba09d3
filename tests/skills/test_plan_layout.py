"""plan-layout: the layouts it lists fit, with the least recompute that fits, come in order of their modelled time,
and its command trains; the launch playbook's table is its choice on 141 and 80 GiB GPUs."""
import os
import re
import subprocess
import sys
from pathlib import Path

from pith_apps.config import flops_per_token
from pith_apps.options import hf_config_data, parse_args
from test_commands import doc_command, shown_output

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "skills/pith-apps/plan-layout/plan_layout.py"
LINE = re.compile(r"pp=(\d+) dp=(\d+) cp=(\d+) ep=(\d+) micro_batch_size=(\d+) recompute=(\w+): peak ([\d.]+) GiB, "
                  r"modelled step ([\d.]+) s")
sys.path.insert(0, str(SCRIPT.parent))
import plan_layout  # noqa: E402
from estimate_memory import GIB, estimate  # noqa: E402


def plan(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)


def test_the_layouts_listed_fit_in_time_order_and_none_is_refused():
    """Qwen3-30B-A3B on 8 GPUs of 141 GiB: five layouts of 8 ranks, each under 141 GiB less the 8% headroom, the
    modelled times ascending, each followed by its torchrun command with its sizes and recompute; 20 GiB fits none,
    not even with full recompute (exit 1)."""
    flags = ["--", "qwen3", "--preset", "30b-a3b", "--device", "cuda", "--seq-len", "4096", "--batch-size", "64"]
    done = plan("--gpus", "8", "--gpu-memory", "141", *flags)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [LINE.match(line).groups() for line in lines[::2]]
    assert len(rows) == 5
    for (pp, dp, cp, ep, micro, recompute, peak, _), launch in zip(rows, lines[1::2]):
        assert int(pp) * int(dp) * int(cp) * int(ep) == 8 and float(peak) <= 141 * 0.92
        assert launch.strip().startswith("hatch run apps:torchrun --nproc-per-node 8 -m pith_apps.train qwen3 "
                                         "--preset 30b-a3b")
        assert f"--micro-batch-size {micro}" in launch and (pp == "1" or f"--pp {pp}" in launch)
        assert (f"--recompute {recompute}" in launch) == (recompute != "none")
    times = [float(row[7]) for row in rows]
    assert times == sorted(times)
    none = plan("--gpus", "8", "--gpu-memory", "20", *flags)
    assert none.returncode == 1 and none.stdout.startswith("no layout of 8 GPUs fits 20 GiB")


def test_on_one_gpu_the_step_is_the_flops_at_the_given_rate():
    """No communication and no pipeline: the modelled step is the training FLOPs at --tflops, to print rounding."""
    train = ["qwen3", "--preset", "30b-a3b", "--layers", "4", "--device", "cuda", "--seq-len", "4096", "--batch-size", "8"]
    done = plan("--gpus", "1", "--gpu-memory", "141", "--tflops", "400", "--", *train)
    seconds = float(LINE.match(done.stdout).group(8))
    flops = flops_per_token(hf_config_data(parse_args(train)), 4096) * 8 * 4096
    assert abs(seconds - flops / 400e12) < 0.006


def test_the_first_plan_trains_as_printed(tmp_path):
    """A tiny run on 2 CPU processes: the first command, run as hatch runs it (python -m torch.distributed.run),
    trains its 2 steps (exit 0, the app's last line); a layout flag given to the plan is refused (exit 2)."""
    train = ["qwen3", "--device", "cpu", "--batch-size", "8", "--seq-len", "64", "--steps", "2", "--save-every", "0",
             "--quiet", "--out", str(tmp_path / "run")]
    done = plan("--gpus", "2", "--gpu-memory", "1", "--", *train)
    launch = done.stdout.splitlines()[1].split()
    assert launch[:3] == ["hatch", "run", "apps:torchrun"] and "--nproc-per-node" in launch
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", *launch[3:]], capture_output=True, text=True)
    assert ran.returncode == 0 and "trained steps 1-2" in ran.stdout, ran.stderr[-2000:]
    refused = plan("--gpus", "2", "--gpu-memory", "1", "--", "qwen3", "--ep", "2")
    assert refused.returncode == 2 and "--ep: the plan chooses the layout" in refused.stderr


def test_the_least_recompute_that_fits_is_chosen_and_charged_its_modelled_work():
    """One GPU, the 4-layer cut, 8 micro-batches of one sequence: with the GPU just large enough for each mode's peak
    (plus the 8% headroom), the plan picks that mode, none before selective before full; its modelled step is the
    training FLOPs plus, of the decoder layers' (the LM head's left out), 3% for selective and a third for full, at
    --tflops (to print rounding: 0.005 s)."""
    train = ["qwen3", "--preset", "30b-a3b", "--layers", "4", "--device", "cuda", "--seq-len", "4096", "--batch-size",
             "8", "--micro-batch-size", "1"]
    hf = hf_config_data(parse_args(train))
    flops = flops_per_token(hf, 4096) * 8 * 4096
    layers = flops - 6 * hf["hidden_size"] * hf["vocab_size"] * 8 * 4096
    modes = ("none", "selective", "full")
    peaks = {mode: estimate(parse_args([*train, "--recompute", mode]))[0]["peak"] / GIB for mode in modes}
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    for mode, extra in (("none", 0), ("selective", 0.03), ("full", 1 / 3)):
        memory = peaks[mode] / 0.92 + 0.001
        found = plan_layout.plan(plan_layout.parse_options(["--gpus", "1", "--gpu-memory", str(memory), "--tflops",
                                                            "400", "--", *train]))
        seconds, _, layout = found[0]
        assert layout["recompute"] == mode and abs(seconds - (flops + extra * layers) / 400e12) < 0.005, (mode, seconds)


# a row of the launch playbook's table: the run, the GPUs, then for 141 and 80 GiB the layout's flags and peak (or
# "none fits" and "-")
TABLE_ROW = re.compile(r"^\| `([^`]+)` \| (\d+) \| (?:`([^`]+)`|none fits) \| ([\d.]+|-) \| (?:`([^`]+)`|none fits) \| "
                       r"([\d.]+|-) \|$", flags=re.M)


def test_every_layout_the_launch_table_gives_fits_as_stated():
    """Each row of skills/pith-apps/launch/SKILL.md's table, for 141 GiB (H200) and 80 GiB (H100) GPUs: the peak is the
    estimate's (to the printed 0.01 GiB) and under the GPU's memory less the plan's 8% headroom; a row of several GPUs
    is plan-layout's first choice, its recompute mode included, and where the row says none fits the plan finds none,
    full recompute included. 4096-token sequences and a global batch of 64 unless the row says otherwise."""
    rows = TABLE_ROW.findall((ROOT / "skills/pith-apps/launch/SKILL.md").read_text())
    assert len(rows) == 12
    for run, gpus, *columns in rows:
        train = [*run.split(), "--device", "cuda", *(["--seq-len", "4096"] * ("--seq-len" not in run)),
                 *(["--batch-size", "64"] * ("--batch-size" not in run))]
        for memory, layout, stated in ((141, *columns[:2]), (80, *columns[2:])):
            if int(gpus) > 1:
                found = plan_layout.plan(plan_layout.parse_options(["--gpus", gpus, "--gpu-memory", str(memory), "--",
                                                                    *train]))
                assert (plan_layout.layout_flags(found[0][2]) if found else "") == layout, (run, memory, found[:1])
            if layout:
                peak = max(row["peak"] for row in estimate(parse_args([*train, *layout.split()]))) / GIB
                assert abs(peak - float(stated)) < 0.006 and peak < memory * 0.92, (run, memory, layout, peak)


def test_the_skills_example_prints_what_its_skill_md_shows():
    """The line of skills/pith-apps/plan-layout/SKILL.md, run as written: its first layout and command are the two
    lines the SKILL.md shows."""
    env, argv = doc_command("skills/pith-apps/plan-layout/SKILL.md", "plan_layout.py")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=os.environ | env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[:2] == shown_output("skills/pith-apps/plan-layout/SKILL.md", "pp=4 dp=1")
