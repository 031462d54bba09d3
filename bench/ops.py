"""pith-ops kernels on one GPU: bandwidth of the memory-bound kernels against the measured device copy,
grouped GEMM TFLOP/s at real expert shapes against torch's grouped_mm and the measured bf16 peak, the expert
weight gradient added into an fp32 master gradient (torch's grouped_mm + add_ against ours), and the
fused LM-head cross-entropy's time and peak memory against torch's logits + F.cross_entropy.

Run on the device machine from the repo root:
  PYTHONPATH=packages/pith-ops/src python3 bench/ops.py      (writes $OUT/ops.json when OUT is set)
"""
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from pith_ops.cross_entropy import linear_cross_entropy
from pith_ops.grouped_gemm import _triton_wgrad, add_wgrad_into, grouped_dgrad, grouped_linear, grouped_wgrad, segment_sum
from pith_ops.swiglu import clamped_swiglu, swiglu, swiglu_backward
from pith_ops.token_permute import (combine_backward_op, combine_tokens, dispatch_backward_op, dispatch_tokens,
                                    sort_by_expert)

DEV, BF16 = "cuda", torch.bfloat16
ROWS = []


def report(**row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def ms(fn):
    return do_bench(fn, warmup=25, rep=200)


def graph_ms(fn):
    """Kernel time without the Python overhead between launches: fn replayed from a CUDA graph. Backward
    kernels are timed by calling their ops directly (the autograd engine cannot be captured)."""
    return do_bench_cudagraph(fn, rep=100)


def peak_tflops():
    a, b = torch.randn(8192, 8192, device=DEV, dtype=BF16), torch.randn(8192, 8192, device=DEV, dtype=BF16)
    return 2 * 8192**3 / ms(lambda: a @ b) / 1e9


def copy_gbps():
    x = torch.empty(2**30 // 2, device=DEV, dtype=BF16)
    return 2 * x.numel() * 2 / ms(lambda: x.clone()) / 1e6


def routing(tokens, top_k, experts):
    scores = torch.rand(tokens, experts, device=DEV)
    weights, ids = torch.topk(scores, top_k)
    return ids, weights.to(BF16)


def bench_memory_bound(copy, tokens=32768, hidden=2048, top_k=8, experts=128, inter=768):
    """Bytes moved over time, as a fraction of the copy bandwidth (read + write)."""
    gate_up = torch.randn(tokens, 2 * inter, device=DEV, dtype=BF16, requires_grad=True)
    out = swiglu(gate_up)
    grad = torch.randn_like(out)
    nbytes = gate_up.numel() * 2 + out.numel() * 2
    t = graph_ms(lambda: swiglu(gate_up))
    report(kernel="swiglu fwd", shape=list(gate_up.shape), ms=round(t, 4), gbps=round(nbytes / t / 1e6), of_copy=round(nbytes / t / 1e6 / copy, 3))
    t = graph_ms(lambda: swiglu_backward(gate_up, grad, 1.0, 0.0, False))
    nbytes = 2 * gate_up.numel() * 2 + grad.numel() * 2
    report(kernel="swiglu bwd", shape=list(gate_up.shape), ms=round(t, 4), gbps=round(nbytes / t / 1e6), of_copy=round(nbytes / t / 1e6 / copy, 3))

    gpt_oss = torch.randn(tokens // 2, 2 * 2880, device=DEV, dtype=BF16) * 4   # GPT-OSS: 4096 tokens x top-4
    clamped = clamped_swiglu(gpt_oss)
    nbytes = gpt_oss.numel() * 2 + clamped.numel() * 2
    t = graph_ms(lambda: clamped_swiglu(gpt_oss))
    report(kernel="clamped swiglu fwd", shape=list(gpt_oss.shape), ms=round(t, 4), gbps=round(nbytes / t / 1e6), of_copy=round(nbytes / t / 1e6 / copy, 3))
    grad = torch.randn_like(clamped)
    t = graph_ms(lambda: swiglu_backward(gpt_oss, grad, 1.702, 7.0, True))
    nbytes = 2 * gpt_oss.numel() * 2 + grad.numel() * 2
    report(kernel="clamped swiglu bwd", shape=list(gpt_oss.shape), ms=round(t, 4), gbps=round(nbytes / t / 1e6), of_copy=round(nbytes / t / 1e6 / copy, 3))

    x = torch.randn(tokens // top_k, hidden, device=DEV, dtype=BF16, requires_grad=True)
    ids, weights = routing(x.shape[0], top_k, experts)
    weights.requires_grad_()
    order, inverse, counts = sort_by_expert(ids, experts)
    slots = order.numel() * hidden * 2
    t = graph_ms(lambda: dispatch_tokens(x, order, inverse, top_k))
    report(kernel="dispatch gather", tokens=x.shape[0], top_k=top_k, ms=round(t, 4), gbps=round(2 * slots / t / 1e6), of_copy=round(2 * slots / t / 1e6 / copy, 3))
    y = torch.randn(order.numel(), hidden, device=DEV, dtype=BF16, requires_grad=True)
    t = graph_ms(lambda: combine_tokens(y, weights, order, inverse, top_k))
    nbytes = slots + x.numel() * 2
    report(kernel="combine fwd", tokens=x.shape[0], top_k=top_k, ms=round(t, 4), gbps=round(nbytes / t / 1e6), of_copy=round(nbytes / t / 1e6 / copy, 3))
    combined = combine_tokens(y, weights, order, inverse, top_k)
    g = torch.randn_like(combined)
    t = graph_ms(lambda: combine_backward_op(g, y, order, inverse, weights, top_k))
    nbytes = 2 * slots + order.numel() * x.shape[1] * 2
    report(kernel="combine bwd", tokens=x.shape[0], top_k=top_k, ms=round(t, 4), gbps=round(nbytes / t / 1e6), of_copy=round(nbytes / t / 1e6 / copy, 3))
    t_ref = graph_ms(lambda: (y.index_select(0, inverse).view(-1, top_k, hidden) * weights[..., None]).sum(1))
    report(kernel="combine fwd, torch index_select+mul+sum", ms=round(t_ref, 4))
    t = graph_ms(lambda: dispatch_backward_op(y, inverse, top_k))
    report(kernel="dispatch bwd (sum of slots)", ms=round(t, 4), gbps=round((slots + x.numel() * 2) / t / 1e6),
           of_copy=round((slots + x.numel() * 2) / t / 1e6 / copy, 3))

    t = graph_ms(lambda: segment_sum(y, counts))
    report(kernel="grouped bias bwd (segment sum)", ms=round(t, 4), gbps=round(slots / t / 1e6), of_copy=round(slots / t / 1e6 / copy, 3))
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=DEV), counts)
    t = graph_ms(lambda: torch.zeros(experts, hidden, device=DEV, dtype=BF16).index_add_(0, expert_of_row, y))
    report(kernel="grouped bias bwd, torch index_add_", ms=round(t, 4))


def bench_grouped_gemm(peak, name, tokens, top_k, experts, hidden, inter):
    ids, _ = routing(tokens, top_k, experts)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    x = torch.randn(tokens * top_k, hidden, device=DEV, dtype=BF16)
    for proj, w in (("gate_up", torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16)),
                    ("down", torch.randn(experts, hidden, inter, device=DEV, dtype=BF16))):
        a = x if proj == "gate_up" else torch.randn(tokens * top_k, inter, device=DEV, dtype=BF16)
        flops = 2 * a.shape[0] * w.shape[1] * w.shape[2]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        row = dict(kernel=f"grouped GEMM {name} {proj} fwd", slots=a.shape[0], experts=experts, n=w.shape[1], k=w.shape[2])
        for label, fn in (("pith", lambda: grouped_linear(a, w, counts)),
                          ("pith_triton", lambda: grouped_linear(a, w, counts, use_triton=True)),
                          ("torch_grouped_mm", lambda: F.grouped_mm(a, w.transpose(-2, -1), offs=offs))):
            tflops = flops / ms(fn) / 1e9
            row[f"{label}_tflops"], row[f"{label}_of_peak"] = round(tflops), round(tflops / peak, 3)
        report(**row)
        grad = torch.randn(a.shape[0], w.shape[1], device=DEV, dtype=BF16)
        for label, fn in (("dgrad", lambda: grouped_dgrad(grad, w, offs)), ("wgrad", lambda: grouped_wgrad(grad, a, offs))):
            tflops = flops / ms(fn) / 1e9
            report(kernel=f"grouped GEMM {name} {proj} {label} (grouped_mm)", tflops=round(tflops),
                   of_peak=round(tflops / peak, 3))


WGRAD_TILES = [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 256, 64, 8, 3),
               (256, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)]


def bench_wgrad_into(name, experts, slots, n_out, n_in):
    """One micro-batch's expert weight gradient added into the fp32 master gradient: torch's grouped_mm (bf16
    out) then add_, against add_wgrad_into, and the Triton kernel's tile shapes (BM, BN, BK, warps, stages)."""
    offs = torch.cumsum(torch.bincount(torch.randint(0, experts, (slots,), device=DEV), minlength=experts), 0,
                        dtype=torch.int32)
    grad, x = torch.randn(slots, n_out, device=DEV, dtype=BF16), torch.randn(slots, n_in, device=DEV, dtype=BF16)
    master = torch.nn.Parameter(torch.zeros(experts, n_out, n_in, device=DEV))
    master.grad = torch.zeros_like(master)
    row = dict(kernel=f"wgrad into fp32 grad, {name}", experts=experts, slots=slots, n_out=n_out, n_in=n_in,
               torch_grouped_mm_then_add_ms=round(ms(lambda: master.grad.add_(grouped_wgrad(grad, x, offs))), 3),
               add_wgrad_into_ms=round(ms(lambda: add_wgrad_into(master, grad, x, offs)), 3))
    for tiles in WGRAD_TILES:
        row[str(tiles)] = round(ms(lambda: _triton_wgrad(grad, x, offs, master.grad, True, blocks=tiles[:3],
                                                         num_warps=tiles[3], num_stages=tiles[4])), 3)
    report(**row)


def bench_cross_entropy(tokens=4096, hidden=2048, vocab=151936):
    h = torch.randn(tokens, hidden, device=DEV, dtype=BF16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEV, dtype=BF16) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=DEV)

    def torch_path():
        F.cross_entropy((h @ w.T).float(), labels, reduction="sum").backward()

    def pith_path():
        linear_cross_entropy(h, w, labels).backward()
    for label, fn in (("torch logits + F.cross_entropy", torch_path), ("pith linear_cross_entropy", pith_path)):
        fn()
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        h.grad = w.grad = None

        def step():
            fn()
            h.grad = w.grad = None
        report(kernel=f"LM head + CE fwd+bwd: {label}", tokens=tokens, vocab=vocab, ms=round(ms(step), 3),
               extra_peak_gib=round(peak, 3))


if __name__ == "__main__":
    import triton
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    peak, copy = peak_tflops(), copy_gbps()
    report(measure="bf16 matmul 8192^3 TFLOP/s", value=round(peak))
    report(measure="device copy GB/s (read + write)", value=round(copy))
    bench_memory_bound(copy)
    bench_grouped_gemm(peak, "Qwen3-30B-A3B", tokens=4096, top_k=8, experts=128, hidden=2048, inter=768)
    bench_grouped_gemm(peak, "DeepSeek-V2-Lite", tokens=4096, top_k=6, experts=64, hidden=2048, inter=1408)
    for name, experts, slots, hidden, inter in (("Qwen3-30B-A3B", 128, 32768, 2048, 768),
                                                ("DeepSeek-V2-Lite", 64, 24576, 2048, 1408),
                                                ("GPT-OSS-20B", 32, 16384, 2880, 2880)):
        bench_wgrad_into(f"{name} gate_up", experts, slots, 2 * inter, hidden)
        bench_wgrad_into(f"{name} down", experts, slots, hidden, inter)
    bench_cross_entropy()
    if os.environ.get("OUT"):
        json.dump(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), rows=ROWS),
                  open(os.path.join(os.environ["OUT"], "ops.json"), "w"), indent=1)
