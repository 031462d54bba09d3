"""Expert parallelism's token exchange on several GPUs (issue 18): pith_engine.moe's dispatch and combine (stages 2
and 4, as the app's MoE layers call them) over all the processes torchrun starts, at a real MoE shape with uniform
random routing. Per process: the median time of dispatch + combine, the rows sent each way (one per token and
destination rank), and the achieved bandwidth, bytes sent to other ranks over the time, against --link-gbs. Each
exchange is checked: combine(dispatch(x)) with the expert identity gives each token its routing weights' sum times
itself.

  python3 -m torch.distributed.run --nproc-per-node 8 bench/all_to_all.py [--tokens 4096] [--hidden 2048]
      [--experts 128] [--top-k 8] [--link-gbs 450]    (--device cpu: gloo on CPU processes)
Rank 0 prints the row and writes $OUT/all_to_all.json when OUT is set.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pith_engine.moe import Routing, combine, dispatch


def exchange_row(args, device) -> dict:
    ranks, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator(device=device).manual_seed(rank)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=generator)
    expert_ids = torch.rand(args.tokens, args.experts, device=device, generator=generator).topk(args.top_k).indices
    weights = torch.rand(args.tokens, args.top_k, device=device, generator=generator).to(dtype)
    routing = Routing(expert_ids, weights)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        sync()
        tic = time.perf_counter()
        rows, plan = dispatch(x, routing, args.experts, dist.group.WORLD)
        back = combine(rows, plan)
        sync()
        times.append(time.perf_counter() - tic)
    expected = x.float() * weights.float().sum(-1, keepdim=True)
    error = ((back.float() - expected).norm() / expected.norm()).item()
    sent = plan.exchange.send_counts
    remote_bytes = 2 * (sum(sent) - sent[rank]) * args.hidden * x.element_size()   # there and back
    median = sorted(times)[len(times) // 2]
    gbs = remote_bytes / median / 1e9
    three_digits = lambda value: float(f"{value:.3g}")   # noqa: E731  (a slow CPU's tiny figures stay above 0)
    return dict(ranks=ranks, rank=rank, tokens=args.tokens, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
                rows_sent=sum(sent), median_ms=three_digits(1e3 * median), gbs=three_digits(gbs),
                link_pct=three_digits(100 * gbs / args.link_gbs), relative_error=error)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096, help="per process")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--link-gbs", type=float, default=450.0, help="one direction of a GPU's links, GB/s "
                        "(default: NVLink 4's 450 of an H100/H200 SXM)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    row = exchange_row(args, device)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        summary = dict(rows[0], gbs=min(r["gbs"] for r in rows), link_pct=min(r["link_pct"] for r in rows),
                       relative_error=max(r["relative_error"] for r in rows), per_rank=rows)
        print(json.dumps({k: v for k, v in summary.items() if k != "per_rank"}), flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "all_to_all.json").write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
