"""Single-GPU training throughput of the three families against Hugging Face transformers, in one run.

Full width, 4 decoder layers, 4096-token sequences, bf16 weights, fused AdamW; a step is `accum`
micro-batches of one sequence, then the optimizer; median of 4 steps after 2 warm-ups (the settings of
../shared/bench/hf_baseline.py, which this script imports and runs on the same GPU for the baseline
numbers, and whose FLOP count it uses so that MFU is counted the same way).

  PYTHONPATH=packages/pith-ops/src:packages/pith-engine/src:packages/pith-apps/src \
    python3 bench/train_throughput.py --baseline ../shared/bench/hf_baseline.py [--families qwen3] [--accum 1 8]

Writes $OUT/train_throughput.json when OUT is set; --profile adds a per-kernel CUDA time table per family.
"""
import argparse
import gc
import importlib.util
import json
import os
import time

import torch

from pith_apps.config import read_json
from pith_apps.train import MODELS, PRESETS
from pith_engine.compile import compile_stages
from pith_engine.optim import adamw

REAL = {"qwen3": ("30b-a3b", "qwen3_moe"), "deepseek_v2": ("lite", "deepseek_v2"), "gpt_oss": ("20b", "gpt_oss")}


def load_baseline(path):
    spec = importlib.util.spec_from_file_location("hf_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name, layers):
    config_cls, model_cls = MODELS[name]
    data = read_json(PRESETS / f"{name}_{REAL[name][0]}.json") | {"num_hidden_layers": layers}
    if name == "gpt_oss":
        data["layer_types"] = data["layer_types"][:layers]
    with torch.device("cuda"):
        model = model_cls(config_cls.from_dict(data)).to(torch.bfloat16)
    with torch.no_grad():   # on the GPU: the CPU generator of init_weights is slow for billions of values
        for param_name, param in model.named_parameters():
            param.fill_(1.0) if param_name.endswith("norm.weight") else param.normal_(0, 0.02)
    return compile_stages(model)


def clean_gpu() -> float:
    """Free what earlier runs left (compiled code holds its layers in reference cycles) and restart the peak
    count, so that each side's peak memory is its own; returns the GiB still allocated."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**30


def run(name, layers, seq, accum, steps=6):
    torch.manual_seed(0)
    model = build(name, layers)
    optimizer = adamw(model, lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(accum):
            loss = model.loss_sum(ids, labels) / (labels != -100).sum() / accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = sorted(times[2:])[len(times[2:]) // 2]
    memory = torch.cuda.max_memory_allocated() / 2**30
    del model, optimizer
    return dict(step_s=round(step, 4), tok_s=round(accum * seq / step), peak_mem_gib=round(memory, 1),
                loss=round(loss.item() * accum, 3))


def profile(name, layers, seq, path):
    """One compiled step of one micro-batch under torch.profiler: CUDA time per kernel, largest first."""
    torch.manual_seed(0)
    model = build(name, layers)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device="cuda")
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    for _ in range(2):
        model.loss_sum(ids, labels).backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.loss_sum(ids, labels).backward()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    open(path, "w").write(table)
    del model
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="path of hf_baseline.py")
    parser.add_argument("--families", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--accum", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--profile", action="store_true", help="also write $OUT/profile_<family>.txt (one step)")
    args = parser.parse_args()
    hf = load_baseline(args.baseline)
    import transformers
    print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(), flush=True)
    peak = hf.peak_tflops()
    print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for name in args.families:
        kind = REAL[name][1]
        flops = hf.flops_per_token(hf.config(kind, args.layers), kind, args.seq)
        for accum in args.accum:
            left = clean_gpu()
            ours = run(name, args.layers, args.seq, accum)
            left = max(left, clean_gpu())
            theirs = hf.run(kind, args.layers, args.seq, "grouped_mm", accum)
            if left > 0.01:
                print(f"warning: {left:.2f} GiB still allocated before a run; peak memory includes it", flush=True)
            row = dict(family=name, accum=accum, pith=ours, hf=theirs,
                       pith_mfu_pct=round(100 * ours["tok_s"] * flops / 1e12 / peak, 1),
                       hf_mfu_pct=round(100 * theirs["tok_s"] * flops / 1e12 / peak, 1),
                       speedup=round(ours["tok_s"] / theirs["tok_s"], 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.profile:
            clean_gpu()
            profile(name, args.layers, args.seq, os.path.join(os.environ.get("OUT", "."), f"profile_{name}.txt"))
    print("\nfamily       accum  pith tok/s  hf tok/s  speedup  pith MFU  hf MFU  pith GiB  hf GiB")
    for r in rows:
        print(f"{r['family']:<12} {r['accum']:>5}  {r['pith']['tok_s']:>10,}  {r['hf']['tok_s']:>8,}  {r['speedup']:>7}"
              f"  {r['pith_mfu_pct']:>7}%  {r['hf_mfu_pct']:>5}%  {r['pith']['peak_mem_gib']:>8}  {r['hf']['peak_mem_gib']:>6}")
    if os.environ.get("OUT"):
        json.dump(dict(peak_tflops=peak, rows=rows), open(os.path.join(os.environ["OUT"], "train_throughput.json"), "w"),
                  indent=1)


if __name__ == "__main__":
    main()
