"""FP8 on one GPU (pith_ops.fp8): the quantize kernels' bandwidth, the block-wise FP8 GEMMs against bf16 at the
three families' dense and expert shapes (an expert GEMM timed as one dense GEMM of all its tokens: the ceiling a
grouped FP8 kernel can reach), the grouped FP8 expert kernel against torch's bf16 grouped_mm, and fp8_linear's forward and backward against F.linear's, called from Python and
replayed from a CUDA graph (the GPU's time alone, as the app's replayed step sees it).

Run on the device machine from the repo root:
  PYTHONPATH=packages/pith-ops/src python3 bench/fp8.py      (writes $OUT/fp8.json when OUT is set)
"""
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from pith_ops.fp8 import (Fp8WeightCache, fp8_grouped_rows, fp8_linear, matmul_rows_blocks, matmul_rows_rows,
                          quantize_blocks, quantize_columns, quantize_rows, transposed)

# (name, experts, routed rows of a 4096-token micro-batch, in K, out N) of each expert GEMM
EXPERTS = [("qwen3 gate_up", 128, 32768, 2048, 1536), ("qwen3 down", 128, 32768, 768, 2048),
           ("deepseek_v2 gate_up", 64, 24576, 2048, 2816), ("deepseek_v2 down", 64, 24576, 1408, 2048),
           ("gpt_oss gate_up", 32, 16384, 2880, 5760), ("gpt_oss down", 32, 16384, 2880, 2880)]

# (name, tokens M, in K, out N): a micro-batch of 4096 tokens; experts: all routed rows of one (top-k x 4096)
SHAPES = [("qwen3 q_proj", 4096, 2048, 4096), ("qwen3 o_proj", 4096, 4096, 2048),
          ("qwen3 experts gate_up", 32768, 2048, 1536), ("qwen3 experts down", 32768, 768, 2048),
          ("deepseek_v2 q_proj", 4096, 2048, 3072), ("deepseek_v2 shared gate_up", 4096, 2048, 5632),
          ("deepseek_v2 experts gate_up", 24576, 2048, 2816), ("deepseek_v2 experts down", 24576, 1408, 2048),
          ("gpt_oss q_proj", 4096, 2880, 4096), ("gpt_oss experts gate_up", 16384, 2880, 5760),
          ("gpt_oss experts down", 16384, 2880, 2880)]


def tflops(m, k, n, ms):
    return round(2 * m * k * n / ms / 1e9, 1)


def measure(name, m, k, n):
    x, w, g = (torch.randn(*shape, device="cuda").bfloat16() for shape in ((m, k), (n, k), (m, n)))
    row = dict(name=name, M=m, K=k, N=n)
    xq, wq, gq = quantize_rows(x), quantize_blocks(w), quantize_rows(g)
    wt, gc, xc = transposed(wq), quantize_columns(g), quantize_columns(x)
    for gemm, bf16, fp8 in [("forward", lambda: x @ w.T, lambda: matmul_rows_blocks(xq, wq)),
                            ("input grad", lambda: g @ w, lambda: matmul_rows_blocks(gq, wt)),
                            ("weight grad", lambda: g.T @ x, lambda: matmul_rows_rows(gc, xc))]:
        row[f"{gemm} TFLOP/s bf16 / fp8"] = (tflops(m, k, n, do_bench(bf16)), tflops(m, k, n, do_bench(fp8)))
    for kernel, tensor in [(quantize_rows, x), (quantize_columns, x), (quantize_blocks, w)]:
        moved = tensor.numel() * 3 + tensor.numel() // 128 * 4   # bf16 read, e4m3 written, fp32 scales
        row[f"{kernel.__name__} GB/s"] = round(moved / do_bench(lambda: kernel(tensor)) / 1e6)
    layer_x = x.detach().requires_grad_()
    weight = torch.nn.Parameter(w.float())
    weight_copy = w.detach().requires_grad_()
    weight_copy.grad_into = weight
    cache = Fp8WeightCache()

    def fp8_layer():
        fp8_linear(layer_x, weight_copy, cache).backward(g)

    def bf16_layer():
        F.linear(layer_x, weight_copy).backward(g)
    row["layer fwd+bwd ms bf16 / fp8 (weight cached)"] = (round(do_bench(bf16_layer), 3), round(do_bench(fp8_layer), 3))
    row["the same replayed from a CUDA graph"] = (round(do_bench_cudagraph(bf16_layer), 3),
                                                  round(do_bench_cudagraph(fp8_layer), 3))
    print(json.dumps(row), flush=True)
    return row


def measure_experts(name, experts, m, k, n):
    """The expert GEMMs over rows routed at random (multinomial counts), torch's bf16 grouped_mm against the FP8
    kernel (its input quantized inside the timing, the weight cached), TFLOP/s."""
    counts = torch.bincount(torch.randint(0, experts, (m,), device="cuda"), minlength=experts)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x, g = torch.randn(m, k, device="cuda").bfloat16(), torch.randn(m, n, device="cuda").bfloat16()
    w = torch.randn(experts, n, k, device="cuda").bfloat16()
    blocks = quantize_blocks(w)
    blocks_t = transposed(blocks)
    row = dict(name=name, experts=experts, M=m, K=k, N=n)
    for gemm, bf16, fp8 in [("forward", lambda: F.grouped_mm(x, w.transpose(1, 2), offs=offs),
                             lambda: fp8_grouped_rows(x, blocks, offs, True)),
                            ("input grad", lambda: F.grouped_mm(g, w, offs=offs),
                             lambda: fp8_grouped_rows(g, blocks_t, offs, True))]:
        row[f"{gemm} TFLOP/s bf16 grouped_mm / fp8 kernel"] = (tflops(m, k, n, do_bench(bf16)),
                                                               tflops(m, k, n, do_bench(fp8)))
    print(json.dumps(row), flush=True)
    return row


def main():
    torch.manual_seed(0)
    rows = [measure_experts(*shape) for shape in EXPERTS] + [measure(*shape) for shape in SHAPES]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8.json"), "w") as out:
            json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), rows=rows), out, indent=1)


if __name__ == "__main__":
    main()
