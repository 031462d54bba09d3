"""The several-GPU benchmark (bench/multi_gpu.py) on 2 CPU processes over gloo at the tiny preset: the app itself
launched by torchrun at each layout, its losses read back and compared with one process's, its speed read back."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "multi_gpu.py"
TINY = ["--device", "cpu", "--gpus", "2", "--family", "qwen3", "--preset", "tiny", "--layers", "4", "--seq", "64",
        "--batch-size", "8", "--steps", "6"]


def bench(tmp_path, *flags) -> list[dict]:
    done = subprocess.run([sys.executable, str(BENCH), *TINY, *flags], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "multi_gpu.json").read_text())


def test_each_layout_follows_the_one_process_run_step_by_step(tmp_path):
    """ep 2, dp 2, pp 2 and cp 2 (the defaults): 6 losses each, equal to one process's as the app prints them (3
    decimals: within 1e-3 of each other, float32 on CPU), and the learning visible (the loss falls)."""
    alone, *layouts = bench(tmp_path, "--check")
    assert [row["layout"] for row in layouts] == ["--ep 2", "--dp 2", "--pp 2 --micro-batch-size 1",
                                                  "--cp 2 --no-compile"]
    assert len(alone["losses"]) == 6 and alone["losses"][-1] < alone["losses"][0] - 0.2, alone
    for row in layouts:
        assert "error" not in row and row["processes"] == 2 and row["max_gap"] < 1e-3, row


def test_throughput_is_read_per_gpu_with_the_mfu_and_an_error_is_the_apps_own_line(tmp_path):
    """--ep 2: the median step's tokens/s, half of it per GPU; per GPU, an MFU between 0 and 100% of the matmul peak
    measured here and, against the data-sheet peak given (--peak-tflops 0.05), the training FLOP/s of half the
    tokens over it to the 3 digits written; --pp 2 at one micro-batch per step: the app's one-line refusal as the
    row's error."""
    from pith_apps.config import flops_per_token
    from pith_apps.options import hf_config_data, parse_args
    ran, refused = bench(tmp_path, "--layouts", "--ep 2", "--pp 2", "--peak-tflops", "0.05")
    assert ran["tokens_per_s_per_gpu"] == round(ran["tokens_per_s"] / 2) > 0, ran
    assert 0 < ran["mfu_matmul_peak_pct"] < 100, ran
    flops = flops_per_token(hf_config_data(parse_args(["qwen3", "--preset", "tiny", "--layers", "4"])), 64)
    assert ran["mfu_datasheet_pct"] == float(f"{100 * ran['tokens_per_s'] / 2 * flops / 0.05e12:.3g}"), ran
    assert refused["error"].startswith("pith-train: error: DualPipeV needs at least 2 x pp = 4 micro-batches"), refused
