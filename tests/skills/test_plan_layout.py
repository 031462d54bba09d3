"""plan-layout: the layouts it lists fit, come in order of their modelled time, and its command trains."""
import re
import subprocess
import sys
from pathlib import Path

from pith_apps.config import flops_per_token
from pith_apps.options import hf_config_data, parse_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "skills/pith-apps/plan-layout/plan_layout.py"
LINE = re.compile(r"pp=(\d+) dp=(\d+) cp=(\d+) ep=(\d+) micro_batch_size=(\d+): peak ([\d.]+) GiB, modelled step "
                  r"([\d.]+) s")


def plan(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)


def test_the_layouts_listed_fit_in_time_order_and_none_is_refused():
    """Qwen3-30B-A3B on 8 GPUs of 141 GiB: five layouts of 8 ranks, each under 141 GiB less the 8% headroom, the
    modelled times ascending, each followed by its torchrun command with its sizes; 20 GiB fits none (exit 1)."""
    flags = ["--", "qwen3", "--preset", "30b-a3b", "--device", "cuda", "--seq-len", "4096", "--batch-size", "64"]
    done = plan("--gpus", "8", "--gpu-memory", "141", *flags)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [LINE.match(line).groups() for line in lines[::2]]
    assert len(rows) == 5
    for (pp, dp, cp, ep, micro, peak, _), launch in zip(rows, lines[1::2]):
        assert int(pp) * int(dp) * int(cp) * int(ep) == 8 and float(peak) <= 141 * 0.92
        assert launch.strip().startswith("torchrun --nproc-per-node 8 -m pith_apps.train qwen3 --preset 30b-a3b")
        assert f"--micro-batch-size {micro}" in launch and (pp == "1" or f"--pp {pp}" in launch)
    times = [float(row[6]) for row in rows]
    assert times == sorted(times)
    none = plan("--gpus", "8", "--gpu-memory", "20", *flags)
    assert none.returncode == 1 and none.stdout.startswith("no layout of 8 GPUs fits 20 GiB")


def test_on_one_gpu_the_step_is_the_flops_at_the_given_rate():
    """No communication and no pipeline: the modelled step is the training FLOPs at --tflops, to print rounding."""
    train = ["qwen3", "--preset", "30b-a3b", "--layers", "4", "--device", "cuda", "--seq-len", "4096", "--batch-size", "8"]
    done = plan("--gpus", "1", "--gpu-memory", "141", "--tflops", "400", "--", *train)
    seconds = float(LINE.match(done.stdout).group(7))
    flops = flops_per_token(hf_config_data(parse_args(train)), 4096) * 8 * 4096
    assert abs(seconds - flops / 400e12) < 0.006


def test_the_first_plan_trains_as_printed(tmp_path):
    """A tiny run on 2 CPU processes: the first command, torchrun run as python -m torch.distributed.run, trains
    its 2 steps (exit 0, the app's last line); a layout flag given to the plan is refused (exit 2)."""
    train = ["qwen3", "--device", "cpu", "--batch-size", "8", "--seq-len", "64", "--steps", "2", "--save-every", "0",
             "--quiet", "--out", str(tmp_path / "run")]
    done = plan("--gpus", "2", "--gpu-memory", "1", "--", *train)
    launch = done.stdout.splitlines()[1].split()
    assert launch[0] == "torchrun" and "--nproc-per-node" in launch
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", *launch[1:]], capture_output=True, text=True)
    assert ran.returncode == 0 and "trained steps 1-2" in ran.stdout, ran.stderr[-2000:]
    refused = plan("--gpus", "2", "--gpu-memory", "1", "--", "qwen3", "--ep", "2")
    assert refused.returncode == 2 and "--ep: the plan chooses the layout" in refused.stderr


def test_every_layout_the_launch_table_gives_fits_as_stated():
    """Each row of skills/pith-apps/launch/SKILL.md's table: its peak is the estimate's (to the printed 0.01 GiB) and
    under 141 GiB less the plan's 8% headroom; a row of several GPUs is plan-layout's first choice."""
    sys.path.insert(0, str(SCRIPT.parent))
    import plan_layout
    from estimate_memory import GIB, estimate
    table = (ROOT / "skills/pith-apps/launch/SKILL.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (\d+) \| `([^`]+)` \| ([\d.]+) \|$", table, flags=re.M)
    assert len(rows) == 11
    for run, gpus, layout, stated in rows:
        train = [*run.split(), "--device", "cuda", "--seq-len", "4096", *(["--batch-size", "64"] * ("--batch-size" not in run))]
        peak = max(row["peak"] for row in estimate(parse_args([*train, *layout.split()]))) / GIB
        assert abs(peak - float(stated)) < 0.006 and peak < 141 * 0.92, (run, layout, peak)
        if int(gpus) > 1:
            first = plan_layout.plan(plan_layout.parse_options(["--gpus", gpus, "--gpu-memory", "141", "--", *train]))[0][2]
            assert " ".join(f"--{k.replace('_', '-')} {v}" for k, v in first.items() if v > 1 or k == "micro_batch_size") == layout
