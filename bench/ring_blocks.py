"""The pieces of context parallelism's ring attention on one GPU, against one attention call over the whole sequence.

A single process cannot ring, so this times what each cp rank computes: its queries (the zigzag part, seq / cp
tokens) against each of the cp blocks of keys and values (compiled flex_attention with the rank's zigzag block
mask, pith_engine.context_parallel.block_attention), their merge by log-sum-exp (merge_blocks, compiled on CUDA)
and the backward of all of it; and, each in its own process, one causal attention over the whole sequence, through SDPA (torch's backend
choice) and through compiled flex_attention. Forward and backward of one layer's attention, bf16, Qwen3-30B-A3B's
heads (32 query, 4 key-value, 128 dims). The sends between ranks are not timed (they overlap the blocks).

    python bench/ring_blocks.py [--seq 32768] [--cp 4] [--window W]   # prints one JSON line per run and a table
"""
import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F


def inputs(seq: int, heads: int, kv_heads: int, dim: int):
    generator = torch.Generator("cuda").manual_seed(0)
    return [torch.randn(1, h, seq, dim, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def timed(run, repeats: int = 10) -> float:
    """Median milliseconds of run() (forward and backward) after 3 warm-up calls."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def whole(args, kind: str) -> float:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    q, k, v = inputs(args.seq, args.heads, args.kv_heads, args.dim)
    if kind == "sdpa":
        attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # noqa: E731
    else:
        window = args.window

        def visible(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < window) if window else qi >= ki
        mask = create_block_mask(visible, None, None, args.seq, args.seq, device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)
        attend = lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True)   # noqa: E731
    return timed(lambda: attend().sum().backward())


def ring_rank(args, rank: int) -> float:
    from pith_engine.context_parallel import block_attention, block_seen, merge_blocks, zigzag_block_mask, zigzag_positions
    local = args.seq // args.cp
    q, k, v = inputs(args.seq, args.heads, args.kv_heads, args.dim)
    mine = zigzag_positions(local, args.cp, rank, "cuda")
    blocks = [(source, zigzag_positions(local, args.cp, source, "cuda")) for source in range(args.cp)
              if block_seen(local, args.cp, rank, source, args.window)]
    masks = {source: zigzag_block_mask(local, args.cp, rank, source, args.window, "cuda") for source, _ in blocks}
    q_mine = q[:, :, mine].detach().requires_grad_()
    kv = {source: (k[:, :, theirs].detach().requires_grad_(), v[:, :, theirs].detach().requires_grad_())
          for source, theirs in blocks}

    def run():
        parts = [block_attention(q_mine, *kv[source], mine, theirs, args.dim ** -0.5, args.window, masks[source])
                 for source, theirs in blocks]
        out, _ = merge_blocks([p[0] for p in parts], [p[1] for p in parts])
        out.sum().backward()
    return timed(run)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--only", help="one run in this process: sdpa, flex or rank:R")
    args = parser.parse_args()
    if args.only:
        ms = whole(args, args.only) if args.only in ("sdpa", "flex") else ring_rank(args, int(args.only.split(":")[1]))
        print(json.dumps(dict(run=args.only, ms=round(ms, 3), seq=args.seq, cp=args.cp, window=args.window,
                              torch=torch.__version__, gpu=torch.cuda.get_device_name())))
        return
    rows = []
    whole_runs = ["flex"] if args.window else ["sdpa", "flex"]   # SDPA has no sliding window
    for only in [*whole_runs, *(f"rank:{r}" for r in range(args.cp))]:
        command = [sys.executable, __file__, "--only", only, *sys.argv[1:]]
        line = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        print(line, flush=True)
        rows.append(json.loads(line))
    ms = {row["run"]: row["ms"] for row in rows}
    slowest = max(time for run, time in ms.items() if run.startswith("rank"))
    for run, time in ms.items():
        print(f"{run:>8}  {time:9.3f} ms")
    print(f"slowest rank {slowest:.3f} ms: " + ", ".join(f"1/{ms[run] / slowest:.2f} of {run} over the whole sequence"
                                                          for run in whole_runs) + f" (ideal: 1/{args.cp})")


if __name__ == "__main__":
    main()
