"""Muon's step on one GPU, part by part, at the real models' expert shapes: Newton-Schulz (pith_engine.muon's
orthogonalize, 5 bf16 iterations) of an expert stack's gate_up matrices stacked whole and split into gate and up,
and of its down matrices, in ms and TFLOP/s against the measured bf16 matmul peak; and the momentum and update
passes over fp32 master weights, as torch ops and as pith_ops' one-pass kernels, in ms and GB/s against the measured
device copy. Each timing is the median of CUDA-graph replays (triton.testing.do_bench_cudagraph).

  PYTHONPATH=packages/pith-ops/src:packages/pith-engine/src python3 bench/muon.py   (writes $OUT/muon.json)
"""
import json
import os

import torch
from triton.testing import do_bench, do_bench_cudagraph

from pith_engine.muon import RMS_MATCH, apply_update, momentum_update, orthogonalize

DEV = "cuda"
EXPERTS = {   # (experts per layer, hidden, expert intermediate), from the presets (../shared/reference/MODELS.md)
    "qwen3 30b-a3b": (128, 2048, 768),
    "deepseek_v2 lite": (64, 2048, 1408),
    "gpt_oss 20b": (32, 2880, 2880),
}


def ns_flops(batch: int, rows: int, columns: int, steps: int = 5) -> float:
    """Three GEMMs an iteration: the Gram matrix, its square, the product with X (m the shorter side)."""
    m, n = sorted((rows, columns))
    return batch * steps * (4 * m * m * n + 2 * m ** 3)


def peak_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192 ** 3 / do_bench(lambda: a @ b, warmup=25, rep=200) / 1e9


def copy_gbps() -> float:
    x = torch.empty(2 ** 28, device=DEV)
    return 2 * x.numel() * 4 / do_bench(lambda: x.clone(), warmup=25, rep=200) / 1e6


def bench_ns(family: str, peak: float) -> list[dict]:
    experts, hidden, inter = EXPERTS[family]
    gate_up, down = torch.randn(experts, 2 * inter, hidden, device=DEV), torch.randn(experts, hidden, inter, device=DEV)
    rows = []
    for name, update, split, matrices in (("gate_up stacked", gate_up, "whole", [(experts, 2 * inter, hidden)]),
                                          ("gate_up split", gate_up, "halves", [(2 * experts, inter, hidden)]),
                                          ("down", down, "whole", [(experts, hidden, inter)])):
        ms = do_bench_cudagraph(lambda: orthogonalize(update, 5, torch.bfloat16, split), rep=50)
        tflops = sum(ns_flops(*m) for m in matrices) / ms / 1e9
        rows.append(dict(family=family, matrices=name, shape=list(update.shape), ms=round(ms, 3),
                         tflops=round(tflops, 1), of_peak=round(tflops / peak, 3)))
    return rows


def bench_passes(family: str, copy: float) -> list[dict]:
    """The momentum (read gradient and buffer, write buffer and the bf16 update) and the update of the weight (read
    weight and the bf16 orthogonal update, write weight) of one layer's expert stacks, fp32 masters."""
    experts, hidden, inter = EXPERTS[family]
    param = torch.nn.Parameter(torch.randn(experts, 3 * inter, hidden, device=DEV))
    param.grad = torch.randn_like(param)
    buffer, orthogonal = torch.zeros_like(param), torch.randn_like(param, dtype=torch.bfloat16)
    group = dict(momentum=0.95, nesterov=True, lr=torch.tensor(1e-3, device=DEV), weight_decay=0.1, split="whole")
    flags = torch.ones((), device=DEV), torch.zeros((), device=DEV)
    moved = param.numel() * (4 * 4 + 2 + 4 * 2 + 2)   # bytes: momentum's 4 fp32 + 1 bf16, update's 2 fp32 + 1 bf16
    rows = []
    for kernel in (False, True):
        @torch.no_grad()   # as the optimizer's step
        def both():
            momentum_update(param, group, buffer, flags, torch.bfloat16, kernel)
            apply_update(param, group, orthogonal, flags, kernel)
        ms = do_bench_cudagraph(both, rep=50)
        rows.append(dict(family=family, passes="kernels" if kernel else "torch ops", parameters=param.numel(),
                         ms=round(ms, 3), gbps_at_minimum_traffic=round(moved / ms / 1e6, 1),
                         of_copy=round(moved / ms / 1e6 / copy, 3)))
    return rows


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    peak, copy = peak_tflops(), copy_gbps()
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, peak_tflops=round(peak, 1),
                  copy_gbps=round(copy, 1), rms_match=RMS_MATCH, rows=[])
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for family in EXPERTS:
        for row in bench_ns(family, peak) + bench_passes(family, copy):
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "muon.json"), "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
