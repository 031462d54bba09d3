"""Several GPUs (issue 18): the app itself under torchrun, each run a process group of its own.

  --check: the first --steps (20) losses of the app at each layout in --layouts (default ep 2, dp 2, pp 2, cp 2)
           against one process on the same global batch; the largest relative gap per layout
  default: throughput of the app at each layout in --layouts on --gpus GPUs: the median step's tokens/s, per GPU,
           MFU per GPU as bench/train_throughput.py counts it (config.flops_per_token times tokens/s per GPU) against
           two peaks: the bf16 matmul peak measured on one GPU in a process of its own (mfu_matmul_peak_pct) and the
           data sheet's dense bf16 peak (mfu_datasheet_pct: 989 TFLOP/s for H100 / H200, or --peak-tflops), and rank
           0's peak memory

Run on the device machine from the repo root, with the three src folders on PYTHONPATH:
  python3 bench/multi_gpu.py --check --gpus 2 --family qwen3 --preset 30b-a3b --layers 4
  python3 bench/multi_gpu.py --gpus 8 --family qwen3 --preset 30b-a3b --layouts "--ep 8" "--ep 4 --dp 2"
  python3 bench/multi_gpu.py --gpus 8 --layouts "--pp 2 --ep 4" "--pp 2 --ep 4 --no-overlap" -- --micro-batch-size 1
           (what the pipeline's overlap of all-to-alls with computation buys)
Anything after -- goes to the app (e.g. -- --micro-batch-size 2). --device cpu runs it all on CPU processes (gloo).
Writes $OUT/multi_gpu.json when OUT is set.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

STEP_LINE = re.compile(r"^step (\d+)/\d+: loss ([-\d.]+)")
LAST_LINE = re.compile(r"^trained steps .*?([\d,]+) tokens/s \(median step\)(?:, peak memory ([\d.]+) GiB)?")


def run_app(processes: int, layout: list[str], app: list[str], out: str) -> dict:
    """The app on `processes` processes (one: plainly) -> its per-step losses, median tokens/s and peak GiB, or the
    error's last line."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)] if processes > 1
              else [sys.executable])
    done = subprocess.run([*launch, "-m", "pith_apps.train", *app, *layout, "--out", out], capture_output=True,
                          text=True)
    lines = done.stdout.splitlines()
    last = next((m for m in map(LAST_LINE.match, lines) if m), None)
    if done.returncode or not last:   # the app's one-line error, else the last line torchrun or Python left
        errors = [line for line in done.stderr.splitlines() if line.startswith("pith-train: error:")]
        return dict(layout=" ".join(layout), error=(errors or done.stderr.strip().splitlines() or ["no output"])[-1])
    losses = [float(m.group(2)) for m in map(STEP_LINE.match, lines) if m]
    return dict(layout=" ".join(layout), processes=processes, losses=losses,
                tokens_per_s=int(last.group(1).replace(",", "")),
                peak_gib=float(last.group(2)) if last.group(2) else None)


def app_args(args) -> list[str]:
    return [args.family, "--preset", args.preset, *(["--layers", str(args.layers)] if args.layers else []),
            "--seq-len", str(args.seq), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--save-every", "0", "--device", args.device, *args.app]


def check(args) -> list[dict]:
    """Each layout's losses against one process's, step by step (the app prints each of up to 20 steps' loss)."""
    base = app_args(args)
    with tempfile.TemporaryDirectory() as folder:
        alone = run_app(1, [], base, f"{folder}/alone")
        rows = [alone]
        for layout in args.layouts:
            row = run_app(args.gpus, layout.split(), base, f"{folder}/{len(rows)}")
            if "losses" in row and "losses" in alone and len(row["losses"]) == len(alone["losses"]):
                row["max_gap"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], alone["losses"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def throughput(args) -> list[dict]:
    from pith_apps.config import flops_per_token
    from pith_apps.options import hf_config_data, parse_args
    from train_throughput import mfu_columns, peaks
    flops = flops_per_token(hf_config_data(parse_args(app_args(args))), args.seq)
    peak = peaks(args)
    print(json.dumps(dict(peak_tflops=peak)), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for layout in args.layouts:
            row = run_app(args.gpus, layout.split(), app_args(args), f"{folder}/{len(rows)}")
            if "tokens_per_s" in row:
                row["tokens_per_s_per_gpu"] = round(row["tokens_per_s"] / args.gpus)
                row |= mfu_columns(row["tokens_per_s"] / args.gpus, flops, peak)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--preset", default="30b-a3b")
    parser.add_argument("--layers", type=int, help="cut the preset to this many layers (default: full depth)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layouts", nargs="+", help="each the app's layout flags, quoted (DualPipeV needs 2 x pp "
                        "micro-batches per step; --cp refuses --compile)",
                        default=["--ep 2", "--dp 2", "--pp 2 --micro-batch-size 1", "--cp 2 --no-compile"])
    parser.add_argument("--device", default="cuda", help="cpu: CPU processes over gloo (the CPU test)")
    parser.add_argument("--peak-tflops", type=float, help="the data-sheet dense bf16 peak per GPU for "
                        "mfu_datasheet_pct (default: the app's by the GPU's name, 989 for H100 / H200; none on a CPU)")
    parser.add_argument("app", nargs="*", help="after --: more flags for the app")
    args = parser.parse_args()
    rows = check(args) if args.check else throughput(args)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "multi_gpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
