"""Profile training steps of the app's own step with torch.profiler: a trace, the heaviest kernels and the time of
each of the MoE layers' five stages.

  hatch run apps:python skills/pith-apps/capture-profile/profile_steps.py --out prof [--warmup 2] [--active 2] \
      -- qwen3 [any other flag of pith-train]

Runs `--warmup` steps, then profiles `--active` more (eagerly: a replayed CUDA graph hides its kernels). Writes, in
--out: trace.json (open in chrome://tracing or https://ui.perfetto.dev), kernels.csv (kernel_name, total_time_ms,
instances, mean_time_ms; GPU kernels on CUDA, operators on the CPU; heaviest first) and stages.csv (stage,
total_time_ms, calls, share_pct: the forward time of each stage of every MoE layer, between CUDA events on the
GPU, over the profiled steps' wall time). Prints the top of both tables.
"""
import argparse
import csv
import functools
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import pith_engine.moe as moe
from pith_apps.data import batch_at
from pith_apps.options import model_config, parse_args
from pith_apps.train import one_process_step, training_tokens
from pith_engine.contract import moe_layers

STAGES = ("1 attention_stage", "2 dispatch", "3 expert_stage", "4 combine", "5 aggregate_stage")


def labelled(name: str, function, timings: dict, cuda: bool):
    """function inside a profiler range named after its stage, its time appended to timings[name]: two CUDA events
    around it on the GPU (read after the steps), the wall time on the CPU, which runs it synchronously."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with record_function(f"stage {name}"):
            if not cuda:
                tic = time.perf_counter()
                out = function(*args, **kwargs)
                timings[name].append((time.perf_counter() - tic) * 1e3)
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = function(*args, **kwargs)
            end.record()
            timings[name].append((start, end))
            return out
    return run


def label_stages(model, timings: dict, cuda: bool):
    """Each MoE layer's stages 1, 3 and 5 and the engine's dispatch and combine (2, 4) timed and named."""
    for layer in moe_layers(model):
        for name in (STAGES[0], STAGES[2], STAGES[4]):
            setattr(layer, name[2:], labelled(name, getattr(layer, name[2:]), timings, cuda))
    moe.dispatch = labelled(STAGES[1], moe.dispatch, timings, cuda)
    moe.combine = labelled(STAGES[3], moe.combine, timings, cuda)


def write_csv(path: Path, header: list[str], rows: list[list]):
    with path.open("w", newline="") as file:
        csv.writer(file).writerows([header, *rows])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder for trace.json, kernels.csv and stages.csv")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before profiling (default: 2)")
    parser.add_argument("--active", type=int, default=2, help="steps profiled (default: 2)")
    parser.add_argument("app", nargs=argparse.REMAINDER, help="-- then the pith-train flags of the run")
    own = parser.parse_args(argv)
    args = parse_args([flag for flag in own.app if flag != "--"] + ["--no-cuda-graph", "--steps",
                                                                     str(own.warmup + own.active)])
    stream = training_tokens(args, model_config(args))
    model, step = one_process_step(args)
    cuda = next(model.parameters()).is_cuda
    timings = {name: [] for name in STAGES}
    label_stages(model, timings, cuda)
    out = Path(own.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [batch_at(stream, n, args.seed, args.batch_size, args.seq_len) for n in range(args.steps)]
    for number in range(1, own.warmup + 1):
        step(number, *batches[number - 1])
    for times in timings.values():
        times.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        tic = time.perf_counter()
        for number in range(own.warmup + 1, args.steps + 1):
            step(number, *batches[number - 1])   # its loss .item() waits for the device
        profiled_ms = (time.perf_counter() - tic) * 1e3
    prof.export_chrome_trace(str(out / "trace.json"))
    events = prof.key_averages()
    if cuda:   # kernels and copies: device events that no host range (stage, optimizer step) shares a name with
        host = {e.key for e in events if e.device_type == torch.autograd.DeviceType.CPU}
        on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in host]
    else:
        on_device = [e for e in events if not e.key.startswith("stage ")]
    own_time = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    kernels = sorted(([e.key, own_time(e) / 1e3, e.count, own_time(e) / 1e3 / e.count] for e in on_device),
                     key=lambda row: -row[1])
    write_csv(out / "kernels.csv", ["kernel_name", "total_time_ms", "instances", "mean_time_ms"],
              [[name, round(total, 4), count, round(mean, 5)] for name, total, count, mean in kernels])
    if cuda:
        torch.cuda.synchronize()
    stages = [[name, sum(start.elapsed_time(end) for start, end in times) if cuda else sum(times), len(times)]
              for name, times in timings.items()]
    write_csv(out / "stages.csv", ["stage", "total_time_ms", "calls", "share_pct"],
              [[name, round(ms, 3), calls, round(100 * ms / profiled_ms, 2)] for name, ms, calls in stages])
    print(f"profiled {own.active} steps: {profiled_ms:.1f} ms; heaviest {'kernels' if cuda else 'operators'}:")
    for name, total, count, _ in kernels[:8]:
        print(f"  {total:>10.2f} ms  {count:>6}x  {name[:90]}")
    print("forward time per MoE stage:")
    for name, ms, calls in stages:
        print(f"  {ms:>10.2f} ms  {calls:>6}x  stage {name}")


if __name__ == "__main__":
    main()
