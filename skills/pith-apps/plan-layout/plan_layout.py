"""The layouts (pp, dp, cp, ep, micro-batch size and recompute mode) of a pith-train run that fit a number of GPUs,
ranked by a modelled step time, each with the torchrun command that launches it.

  hatch run apps:python skills/pith-apps/plan-layout/plan_layout.py --gpus 8 --gpu-memory 141 -- qwen3 --preset 30b-a3b \
      --device cuda --seq-len 4096 --batch-size 64

Every layout the app accepts (sizes whose product is --gpus; without --micro-batch-size, each micro-batch size
dividing a data rank's share) is estimated by estimate-memory with the least recompute that fits (--recompute none,
else selective, else full; or the one given) and kept when its peak is under --gpu-memory less --headroom. The step
time is a model, for ranking, not a measurement: the training FLOPs at --tflops per GPU, plus what the recompute
runs again (modelled, not measured: full one more forward of the decoder layers, a third more of their work;
selective the elementwise work, taken as 3% of it, not the attention it also runs again for GPT-OSS and under
--cp), stretched by the DualPipeV schedule's bubble (pith_engine.dualpipev.simulate), plus, taken as not
overlapped, the experts' all-to-all, FSDP2's gathers and reduce-scatter and the ring's key/value blocks, over
NVLink within a node of --gpus-per-node and the network beyond.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "estimate-memory"))
from estimate_memory import GIB, estimate  # noqa: E402

from pith_apps.config import ConfigError, flops_per_token  # noqa: E402
from pith_apps.options import hf_config_data, parse_args  # noqa: E402
from pith_apps.train import compute_dtype, micro_batches_per_rank  # noqa: E402
from pith_engine.dualpipev import simulate  # noqa: E402
from pith_engine.parallel import LayoutError, Parallel  # noqa: E402
from pith_engine.recompute import MODES  # noqa: E402

LAYOUT_FLAGS = ("--pp", "--dp", "--cp", "--ep", "--micro-batch-size")
# the share of the decoder layers' training work (3 forwards' worth) that a recompute adds: full one forward more;
# selective the norms, rotary, SwiGLU activations, softmaxes and gathers again, elementwise (modelled, not measured)
RECOMPUTE_COST = dict(none=0.0, selective=0.03, full=1 / 3)


def layouts(gpus: int):
    """(pp, dp, cp, ep) with product gpus."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for pp in divisors:
        for cp in divisors:
            for ep in divisors:
                if gpus % (pp * cp * ep) == 0:
                    yield pp, gpus // (pp * cp * ep), cp, ep


def step_seconds(args, options, hf: dict, peak_rows) -> float:
    """The modelled time of one optimizer step of run `args` (its layout set), hf its Hugging Face config."""
    gpus, width = options.gpus, compute_dtype(args, torch.device(args.device)).itemsize
    layers_flops = flops_per_token(hf, args.seq_len) - 6 * hf["hidden_size"] * hf["vocab_size"]   # not the LM head
    flops = flops_per_token(hf, args.seq_len) + RECOMPUTE_COST[args.recompute] * layers_flops
    compute = flops * args.batch_size * args.seq_len / (gpus * options.tflops * 1e12)
    data_ranks = args.dp * args.ep
    micro_batches = micro_batches_per_rank(args, Parallel(args.pp, args.dp, args.cp, args.ep))
    if args.pp > 1:
        timelines, bubbles = simulate(args.pp, micro_batches)
        span = max(line[-1][1] for line in timelines)
        compute *= span / (span - max(bubbles))
    def seconds(nbytes: float, group: int, inner: int) -> float:   # inner: the ranks between two neighbours
        within = group * inner <= options.gpus_per_node
        return nbytes * (group - 1) / group / ((options.nvlink_gbs if within else options.network_gbs) * 1e9)
    tokens = args.batch_size // data_ranks * args.seq_len // args.cp   # per rank per step
    layers = hf["num_hidden_layers"]
    moe_layers = (layers - hf.get("first_k_dense_replace", 0)) / args.pp
    top_k = hf["num_experts_per_tok"]
    exchange = seconds(4 * tokens * top_k * hf["hidden_size"] * width * moe_layers, args.ep, 1) if args.ep > 1 else 0
    held = max(row["weights"] for row in peak_rows) / 4 * args.dp * args.cp   # elements a dp x cp group shards
    shards = args.dp * args.cp
    fsdp = seconds(held * (2 * width * micro_batches + 4), shards, args.ep) if shards > 1 else 0
    # keys and values (taken as wide as the hidden state) pass cp - 1 times forward, and with their gradients back
    kv = tokens * 2 * hf["hidden_size"] * width * layers / args.pp
    ring = seconds(3 * kv * args.cp, args.cp, args.ep) if args.cp > 1 else 0
    return compute + exchange + fsdp + ring


def command(options, layout: dict) -> str:
    nodes = max(1, options.gpus // options.gpus_per_node)
    per_node = options.gpus // nodes
    launch = (f"hatch run apps:torchrun --nproc-per-node {per_node}" if nodes == 1 else f"hatch run apps:torchrun "
              f"--nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500")
    skip = ("recompute",) * options.recompute_given   # then in the run's flags already
    return f"{launch} -m pith_apps.train {' '.join(options.train)} {layout_flags(layout, skip)}"


def layout_flags(layout: dict, skip=()) -> str:
    """The app's flags of a layout: its sizes above 1, the micro-batch size, a recompute mode other than none."""
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in layout.items()
                    if name not in skip and (name == "micro_batch_size" or value not in (1, "none")))


def plan(options) -> list[tuple[float, float, dict]]:
    """(step seconds, peak bytes, layout) of each layout that fits, fastest first; a layout's recompute the least
    that fits (--recompute given after --: that one only)."""
    base = parse_args(options.train)
    hf, fitting = hf_config_data(base), []
    modes = [base.recompute] if options.recompute_given else MODES
    for pp, dp, cp, ep in layouts(options.gpus):
        share, found = base.batch_size // (dp * ep), []
        sizes = [base.micro_batch_size] if base.micro_batch_size else [m for m in range(1, share + 1) if share % m == 0]
        for micro in sizes if base.batch_size % (dp * ep) == 0 else []:
            found += least_recompute(options, hf, dict(pp=pp, dp=dp, cp=cp, ep=ep, micro_batch_size=micro), modes)
        fitting += sorted(found, key=lambda f: (f[0], -f[2]["micro_batch_size"]))[:1]   # the fastest; of ties the largest
    return sorted(fitting, key=lambda f: f[0])


def least_recompute(options, hf: dict, sizes: dict, modes) -> list[tuple[float, float, dict]]:
    """[(step seconds, peak bytes, layout)] of the layout `sizes` with the first of `modes` whose peak fits; [] when
    none fits or the app would refuse the layout."""
    for mode in modes:
        layout = sizes | dict(recompute=mode)
        args = parse_args([*options.train, *(f"--{k.replace('_', '-')}={v}" for k, v in layout.items())])
        try:
            rows = estimate(args)
        except (ConfigError, LayoutError):
            return []
        peak = max(row["peak"] for row in rows)
        if peak <= options.gpu_memory * GIB * (1 - options.headroom):
            return [(step_seconds(args, options, hf, rows), peak, layout)]
    return []


def parse_options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[2])
    add = parser.add_argument
    add("--gpus", type=int, required=True, help="GPUs in all")
    add("--gpu-memory", type=float, required=True, help="GiB per GPU")
    add("--gpus-per-node", type=int, default=8, help="GPUs that NVLink joins (default: 8)")
    add("--headroom", type=float, default=0.08, help="share of a GPU kept for the CUDA context, NCCL and fragmentation "
        "(default: 0.08)")
    add("--tflops", type=float, default=490.0, help="bf16 TFLOP/s a GPU sustains (default: 490, half the H100 / H200 "
        "data sheet's 989; the app's step sustained 409-446 on one H200, bench/RESULTS.md session 18)")
    add("--nvlink-gbs", type=float, default=400.0, help="GB/s each way per GPU within a node (default: 400)")
    add("--network-gbs", type=float, default=45.0, help="GB/s each way per GPU between nodes (default: 45)")
    add("--top", type=int, default=5, help="layouts to list (default: 5)")
    add("train", nargs=argparse.REMAINDER, help="-- then pith-train's model and flags, without the layout's")
    options = parser.parse_args(argv)
    options.train = [a for a in options.train if a != "--"]
    options.recompute_given = any(a.split("=")[0] == "--recompute" for a in options.train)
    return options


def main(argv=None) -> int:
    options = parse_options(argv)
    given = [flag for flag in LAYOUT_FLAGS if any(a.split("=")[0] == flag for a in options.train)]
    try:
        if given:
            raise ConfigError(f"{', '.join(given)}: the plan chooses the layout; leave them out")
        found = plan(options)
    except (ConfigError, LayoutError) as err:
        print(f"plan_layout: error: {err}", file=sys.stderr)
        return 2
    if not found:
        print(f"no layout of {options.gpus} GPUs fits {options.gpu_memory:g} GiB (less {options.headroom:.0%} "
              "headroom): use more GPUs or a shorter --seq-len")
        return 1
    run = parse_args(options.train)
    for seconds, peak, layout in found[:options.top]:
        tokens_per_gpu = run.batch_size * run.seq_len / seconds / options.gpus
        named = " ".join(f"{k}={v}" for k, v in layout.items())
        print(f"{named}: peak {peak / GIB:.2f} GiB, modelled step {seconds:.2f} s ({tokens_per_gpu:,.0f} tokens/s per GPU)")
        print(f"  {command(options, layout)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
