"""Train with the app's step on one process and record, at chosen steps, which experts chosen MoE layers routed each
token to and with what weights; then draw each layer's expert load over the recorded steps.

  hatch run apps:python skills/pith-apps/collect-routing-trace/trace_routing.py --out trace [--layers 1,3] [--every 10] \
      -- qwen3 --steps 100 [any other flag of pith-train]

Writes trace/step-NNNNNNNN.safetensors per recorded step (layer.L.expert_ids int32 [tokens, top_k] and
layer.L.weights float32 [tokens, top_k], all micro-batches of the step in order) and trace/load-layer-L.png (a
row per recorded step, a column per expert: white at the step's mean load, red up to 4x it, blue down to a
quarter; labelled axes and colour scale). Prints one line per recorded step: the loss and each traced layer's busiest expert with its share of the slots.
"""
import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pith_apps.options import model_config, parse_args
from pith_apps.run_log import load_figure
from pith_apps.data import batch_at
from pith_apps.train import one_process_step, training_tokens


def record_routing(layer, into: list):
    """Wrap the layer's stage 1 so that each call appends its routing (int32 ids, fp32 weights) to `into`."""
    stage = layer.attention_stage

    def recorded(x, *args):
        hidden, tokens, routing = stage(x, *args)
        into.append((routing.expert_ids.detach().to(torch.int32).cpu(), routing.weights.detach().float().cpu()))
        return hidden, tokens, routing
    layer.attention_stage = recorded


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder for the trace")
    parser.add_argument("--layers", help="the MoE layers to trace, comma-separated numbers (default: all)")
    parser.add_argument("--every", type=int, default=1, help="record steps N, 2N, ... (default: every step)")
    parser.add_argument("app", nargs=argparse.REMAINDER, help="-- then the pith-train flags of the run")
    own = parser.parse_args(argv)
    args = parse_args([flag for flag in own.app if flag != "--"] + ["--no-cuda-graph"])   # a replay skips Python
    stream = training_tokens(args, model_config(args))
    model, step = one_process_step(args)
    moe = {n: layer for n, layer in model.layers.items() if layer.is_moe}
    chosen = [int(n) for n in own.layers.split(",")] if own.layers else list(moe)
    if not set(chosen) <= set(moe):
        sys.exit(f"trace_routing: --layers {own.layers}: the MoE layers of this model are {sorted(moe)}")
    calls = {n: [] for n in chosen}
    for n in chosen:
        record_routing(moe[n], calls[n])
    out, loads = Path(own.out), {n: [] for n in chosen}
    out.mkdir(parents=True, exist_ok=True)
    for number in range(1, args.steps + 1):
        loss = step(number, *batch_at(stream, number - 1, args.seed, args.batch_size, args.seq_len))[0]
        if number % own.every == 0:
            tensors, busiest = {}, []
            for n in chosen:
                ids, weights = (torch.cat(parts) for parts in zip(*calls[n]))
                tensors |= {f"layer.{n}.expert_ids": ids, f"layer.{n}.weights": weights}
                load = torch.bincount(ids.flatten().long(), minlength=moe[n].num_experts).float()
                loads[n].append(load)
                busiest.append(f"layer {n}: expert {int(load.argmax())} {load.max() / load.sum():.1%}")
            save_file(tensors, out / f"step-{number:08d}.safetensors")
            print(f"step {number}: loss {loss:.3f}; busiest " + ", ".join(busiest), flush=True)
        for n in chosen:
            calls[n].clear()
    for n in chosen:
        if loads[n]:
            steps = range(own.every, own.every * len(loads[n]) + 1, own.every)
            load_figure(torch.stack(loads[n]), f"MoE layer {n}: expert load per recorded step", rows="step",
                        row_names=steps).save(out / f"load-layer-{n}.png")


if __name__ == "__main__":
    main()
