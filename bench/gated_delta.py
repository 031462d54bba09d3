"""The gated delta rule on one GPU at Qwen3.5-35B-A3B's head layout (16 key heads, 32 value heads, 128 x 128 state),
one 4096-token sequence: forward + backward time and peak memory of each way to run it, each in its own process.

  fla        fla-core's chunked Triton kernels, as pith_ops.gated_delta calls them (bf16 q, k, v; fp32 state), with
             the relative error of its output, final state and six gradients against the fp32 reference
  fla-widened  the same through gated_delta_from_unknown_state (values widened by zeros, the state started from
             [0 | I]): the call Qwen3.5's layers make under --cp, its errors likewise
  reference  pith_ops.gated_delta's torch reference (chunked_gated_delta, fp32, eager)
  compiled   the same reference under torch.compile

Run on the device machine from the repo root (fla-core installed for the fla row):
  PYTHONPATH=packages/pith-ops/src python3 bench/gated_delta.py [--seq 4096] [--lift-fla-guard]
  (writes $OUT/gated_delta.json)
"""
import argparse
import json
import os
import subprocess
import sys


def lift_fla_hopper_guard():
    """fla-core refuses Triton 3.4-3.7.0 on Hopper GPUs (its issue 640: a miscompile at 64-wide key blocks, where
    Qwen3.5's 128-dim keys take 128-wide blocks): lifted for a measurement on such a machine, the kernels' results
    checked at the measured shape (the fla row's errors; tests/ops/test_gated_delta.py's GPU test)."""
    from fla.ops.common import chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True


def measure(way: str, seq: int, lift_guard: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from pith_ops import gated_delta as rule
    torch.manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, device="cuda")   # noqa: E731
    fla = way.startswith("fla")
    dtype = torch.bfloat16 if fla else torch.float32
    leaves = [draw(1, seq, 16, 128).to(dtype), draw(1, seq, 16, 128).to(dtype), draw(1, seq, 32, 128).to(dtype),
              -F.softplus(draw(1, seq, 32)) * 0.5, draw(1, seq, 32).sigmoid(), torch.zeros(1, 32, 128, 128, device="cuda")]
    if way == "fla-widened":   # no starting state: the call gives the output and final state for any
        leaves = leaves[:5]
    if lift_guard:
        lift_fla_hopper_guard()
    rule.uses_fla("cuda")
    if not fla:
        rule.FAST_RULES["cuda"] = None

    def widened(*inputs, scale):
        (zeroed, seen), final = rule.gated_delta_from_unknown_state(*inputs, scale)
        return torch.cat([zeroed, seen], dim=-1), final
    run = widened if way == "fla-widened" else torch.compile(rule.gated_delta) if way == "compiled" else rule.gated_delta

    def step(inputs):
        inputs = [t.detach().requires_grad_() for t in inputs]
        out, state = run(*inputs, scale=128 ** -0.5)
        (out.float().sum() + state.sum()).backward()
        return [out, state, *(t.grad for t in inputs)]
    results = step(leaves)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = do_bench(lambda: step(leaves), warmup=5, rep=50)
    row = dict(way=way, seq=seq, ms=round(ms, 3), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
               rule=str(rule.FAST_RULES["cuda"]))
    if fla:
        rule.FAST_RULES["cuda"] = None
        reference = step([t.float() if t.dtype == torch.bfloat16 else t for t in leaves])
        row["relative_errors"] = [f"{((a.double() - b.double()).norm() / b.double().norm()).item():.2e}"
                                  for a, b in zip(results, reference)]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--ways", nargs="+", default=["fla", "fla-widened", "reference", "compiled"])
    parser.add_argument("--lift-fla-guard", action="store_true", help="run fla-core on a Hopper GPU with Triton "
                        "3.4-3.7.0, which it refuses (lift_fla_hopper_guard)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.seq, args.lift_fla_guard)))
        return
    rows = []
    for way in args.ways:
        command = [sys.executable, __file__, "--one", way, "--seq", str(args.seq)] + ["--lift-fla-guard"] * args.lift_fla_guard
        done = subprocess.run(command, capture_output=True, text=True)
        row = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else dict(way=way, error=done.stderr[-800:])
        print(json.dumps(row), flush=True)
        rows.append(row)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gated_delta.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
