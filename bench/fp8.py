"""FP8 on one GPU (pith_ops.fp8): the quantize kernels' bandwidth, the block-wise FP8 GEMMs against bf16 at the
three families' dense and expert shapes (an expert GEMM timed as one dense GEMM of all its tokens: the ceiling a
grouped FP8 kernel can reach), the grouped FP8 expert kernel against torch's bf16 grouped_mm, and fp8_linear's forward and backward against F.linear's, called from Python and
replayed from a CUDA graph (the GPU's time alone, as the app's replayed step sees it).

Run on the device machine from the repo root:
  PYTHONPATH=packages/pith-ops/src python3 bench/fp8.py      (writes $OUT/fp8.json when OUT is set)
  ... --experts ["qwen3 gate_up" ...]: the expert GEMMs alone (those named, or all), with torch's rowwise-scaled FP8
      grouped GEMM and the bf16 weight gradients (torch's grouped_mm; pith's kernel adding into fp32) beside them
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from pith_ops.grouped_gemm import add_wgrad_into
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


def rowwise(x: torch.Tensor, dim: int, groups=None):
    """x quantized to e4m3 with one fp32 scale (amax / 448) per slice along `dim`, the slices cut at the running
    sums `groups` along the other dimension if given: (q, scales) as torch's rowwise scaled_grouped_mm reads them."""
    if groups is None:
        amax = x.float().abs().amax(dim)
        scale = (amax / 448).clamp(min=1e-12)
        return (x.float() / scale.unsqueeze(dim)).to(torch.float8_e4m3fn), scale
    counts = torch.diff(groups, prepend=groups.new_zeros(1)).long()
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)   # rows along 1 - dim
    rows = x.float() if dim == 0 else x.float().T   # [tokens, features]
    amax = torch.zeros(counts.numel(), rows.shape[1], device=x.device).index_reduce_(0, owner, rows.abs(), "amax")
    scale = (amax / 448).clamp(min=1e-12)   # [groups, features]
    q = (rows / scale[owner]).to(torch.float8_e4m3fn)
    return (q if dim == 0 else q.T), scale.flatten()


def measure_rowwise(x, w, g, offs, row):
    """torch's rowwise-scaled grouped FP8 GEMM (CUTLASS) at the same shapes, the operands quantized outside the
    timing: forward x @ w[e].T, input gradient g @ w[e], weight gradient g[e].T @ x[e] (scales per expert and
    feature)."""
    m, k, n = x.shape[0], x.shape[1], g.shape[1]
    xq, xs = rowwise(x, 1)
    gq, gs = rowwise(g, 1)
    w_fwd, ws_fwd = rowwise(w, 2)                                   # [E, N, K], scales [E, N]
    w_bwd, ws_bwd = rowwise(w.transpose(1, 2).contiguous(), 2)      # [E, K, N], scales [E, K]
    # the weight gradient's groups run along the GEMM's K, which torch wants in whole 16-byte steps: each expert's
    # rows rounded down to a multiple of 16, the last expert taking the rest (the bf16 row below uses the same)
    counts = torch.diff(offs, prepend=offs.new_zeros(1)) // 16 * 16
    counts[-1] += m - counts.sum()
    offs16 = torch.cumsum(counts, 0, dtype=torch.int32)
    g_t, gs_t = rowwise(g, 0, offs16)                               # scales per expert and output feature
    x_t, xs_t = rowwise(x, 0, offs16)
    g_t, x_t = g_t.T.contiguous(), x_t.T.contiguous()               # [N, M], [K, M]
    runs = [("forward", lambda: torch._scaled_grouped_mm(xq, w_fwd.transpose(1, 2), xs, ws_fwd, offs=offs,
                                                         out_dtype=torch.bfloat16)),
            ("input grad", lambda: torch._scaled_grouped_mm(gq, w_bwd.transpose(1, 2), gs, ws_bwd, offs=offs,
                                                            out_dtype=torch.bfloat16)),
            ("weight grad", lambda: torch._scaled_grouped_mm(g_t, x_t.T, gs_t, xs_t, offs=offs16,
                                                             out_dtype=torch.bfloat16))]
    exact = [F.grouped_mm(x, w.transpose(1, 2), offs=offs), F.grouped_mm(g, w, offs=offs),
             F.grouped_mm(g.T, x, offs=offs16)]
    bf16_wgrad = do_bench(lambda: F.grouped_mm(g.T, x, offs=offs16))
    row["weight grad TFLOP/s bf16 grouped_mm, groups of 16s"] = tflops(m, k, n, bf16_wgrad)
    for (gemm, run), want in zip(runs, exact):
        error = (run().float() - want.float()).norm() / want.float().norm()
        row[f"{gemm} TFLOP/s fp8 rowwise scaled_grouped_mm"] = tflops(m, k, n, do_bench(run))
        row[f"{gemm} rowwise relative error"] = round(error.item(), 4)


def measure_experts(name, experts, m, k, n, with_rowwise=False):
    """The expert GEMMs over rows routed at random (multinomial counts), torch's bf16 grouped_mm against the FP8
    kernel (its input quantized inside the timing, the weight cached), TFLOP/s; with_rowwise: also torch's
    rowwise-scaled FP8 grouped GEMM (measure_rowwise), and pith's bf16 weight-gradient kernel adding into fp32."""
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
    if with_rowwise:
        master = torch.zeros(experts, n, k, device="cuda", requires_grad=True)
        master.grad = torch.zeros_like(master)
        wgrad = do_bench(lambda: add_wgrad_into(master, g, x, offs))
        row["weight grad TFLOP/s pith kernel into fp32"] = tflops(m, k, n, wgrad)
        measure_rowwise(x, w, g, offs, row)
    print(json.dumps(row), flush=True)
    return row


def main():
    torch.manual_seed(0)
    if "--experts" in sys.argv:   # the expert GEMMs only (those named after it, or all), torch's rowwise FP8 beside
        named = sys.argv[sys.argv.index("--experts") + 1:]
        rows = [measure_experts(*shape, with_rowwise=True) for shape in EXPERTS if not named or shape[0] in named]
    else:
        rows = [measure_experts(*shape) for shape in EXPERTS] + [measure(*shape) for shape in SHAPES]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8.json"), "w") as out:
            json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), rows=rows), out, indent=1)


if __name__ == "__main__":
    main()
