"""Each pipeline rank's memory for a pith-train run on its layout: weights, gradients, AdamW state, compute
copies, FP8 cache, activations and transients, and the peak they add up to.

  python skills/pith-apps/estimate-memory/estimate_memory.py [--gpu-memory GIB] -- qwen3 --preset 30b-a3b \
      --seq-len 4096 --batch-size 64 --micro-batch-size 1 --dp 8 --ep 8 [any other flag of pith-train]

The weights are counted exactly from the model built on the meta device, each rank's part as the app shards it:
experts split over ep, then over dp x cp (FSDP2), every other weight over dp x cp x ep, a pipeline rank holding its
two DualPipeV chunks (rank 0 also the embedding, final norm and LM head). Activations are per token, per layer, of
what the CUDA path keeps for the backward (activations_per_token), times the micro-batches in flight: one without
a pipeline, with one the most that the rank's DualPipeV schedule holds at once (in_flight). Prints a table and the
peak; with --gpu-memory, exits 1 when a rank's peak does not fit.
"""
import argparse
import math
import sys

import torch

from pith_apps.config import ConfigError, qwen3_5_layer_types
from pith_apps.models.layers import Linear, LocalExperts
from pith_apps.options import MODELS, check_args, hf_config_data, model_config, parse_args
from pith_apps.train import check_layout, compute_dtype, micro_batch_size, micro_batches_per_rank
from pith_engine.contract import moe_layers
from pith_engine.dualpipev import chunk_layers, held_layers, schedule
from pith_engine.parallel import LayoutError, Parallel

GIB = 2**30
LOSS_CHUNK = 4096   # tokens per chunk of pith_ops.cross_entropy.linear_cross_entropy


def activations_per_token(hf: dict, layer: int, width: int) -> tuple[float, float]:
    """(bytes a token leaves in decoder layer `layer` for the backward, of them the experts' weight-gradient inputs
    that a paired or deferred weight gradient keeps longer), computing in `width`-byte floats. Counted from the
    stages: the norms' inputs and outputs, q, k, v and the attention output (plus its fp32 log-sum-exp), the
    router's fp32 probabilities, and per routed slot the expert input, the gate/up output, the activation and the
    expert output the combine weighs."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf["model_type"] == "deepseek_v2":
        qk, v = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]
        latent = 2 * hf["kv_lora_rank"] + hf["qk_rope_head_dim"] + heads * (hf["qk_nope_head_dim"] + v)
        attention = width * (latent + heads * (2 * qk + 2 * v))
        dense = hf["first_k_dense_replace"] > layer
        experts, top_k, inner = hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
        shared = 3 * hf["n_shared_experts"] * inner
    elif hf["model_type"] == "qwen3_5_moe_text":
        return qwen3_5_activations(hf, layer, width)
    else:
        qk_heads = heads + hf["num_key_value_heads"]
        extra = qk_heads if hf["model_type"] == "qwen3_moe" else 0   # Qwen3's per-head q/k norms keep their inputs
        attention = width * hf["head_dim"] * (2 * heads + 2 * hf["num_key_value_heads"] + extra)
        dense, shared = False, 0
        experts, top_k = hf.get("num_experts") or hf["num_local_experts"], hf["num_experts_per_tok"]
        inner = hf["moe_intermediate_size"] if hf["model_type"] == "qwen3_moe" else hf["intermediate_size"]
    attention += width * 4 * h + 4 * heads   # two norms' inputs and outputs; the log-sum-exp
    if dense:
        return attention + width * 3 * hf["intermediate_size"], 0.0
    wgrad_inputs = width * top_k * (2 * h + 3 * inner)   # expert input and output gradient; gate/up grad, activation
    routed = width * top_k * (2 * h + 3 * inner) + 4 * experts
    return attention + routed + width * shared, wgrad_inputs


def qwen3_5_activations(hf: dict, layer: int, width: int) -> tuple[float, float]:
    """activations_per_token of a Qwen3.5-MoE layer: a full-attention layer's q, its gate, k, v, the output and the
    q/k norms' inputs; a linear-attention layer's q, k, v before and after the convolution, z, the rule's output
    and its norm, the fp32 q, k, v the chunked rule takes and its three chunk-by-chunk fp32 matrices per value
    head; then the MoE as the others', with the shared expert."""
    h, top_k, inner = hf["hidden_size"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    if qwen3_5_layer_types(hf)[layer] == "full_attention":
        heads, kv, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        mixer = width * head_dim * (4 * heads + 3 * kv)
    else:
        v_heads, k_dim, v_dim = hf["linear_num_value_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        qkv = 2 * hf["linear_num_key_heads"] * k_dim + v_heads * v_dim
        mixer = width * (2 * qkv + 3 * v_heads * v_dim) + 4 * v_heads * (2 * k_dim + v_dim + 3 * 64)
    wgrad_inputs = width * top_k * (2 * h + 3 * inner)
    routed = wgrad_inputs + 4 * hf["num_experts"] + width * 3 * hf["shared_expert_intermediate_size"]
    return mixer + width * 4 * h + routed, wgrad_inputs


def in_flight(pp: int, micro_batches: int, rank: int, chunk_bytes: list[tuple[float, float]]) -> float:
    """The most activation bytes pipeline rank `rank` holds at once under its DualPipeV schedule, chunk_bytes[p]
    being (all, weight-gradient inputs) of one micro-batch of phase p: a forward adds them, a backward frees them,
    a deferring one all but the weight-gradient inputs, which the W steps free, the oldest first."""
    if pp == 1:
        return max(total for total, _ in chunk_bytes)
    held = peak = 0.0
    deferred = []
    for steps in schedule(pp, micro_batches, rank):
        for step in steps:
            if step.kind == "W":
                held -= deferred.pop(0)
                continue
            total, wgrad = chunk_bytes[step.phase]
            if step.kind == "F":
                held += total
            else:
                held -= total - wgrad * step.defer
                deferred += [wgrad] * step.defer
            peak = max(peak, held)
    return peak


def weight_elements(model: torch.nn.Module, layout: dict, compiled: bool) -> dict:
    """Per-rank element counts of the model's weights (built on meta for this pipeline rank): `local` what the
    rank keeps (the largest FSDP2 shard, as torch.chunk splits), `gathered` the largest layer unsharded and `root`
    the rest unsharded (what FSDP2 gathers in the compute dtype), `fp8` the elements of each weight --fp8
    quantizes, unsharded (what the FP8 cache is given: the gathered weight)."""
    dense_shards, expert_shards = layout["dp"] * layout["cp"] * layout["ep"], layout["dp"] * layout["cp"]
    counts = dict(local=0, gathered=0, root=0, fp8=[])
    for layer in model.model.layers.values():
        total = 0
        for name, param in layer.named_parameters():
            expert = ".experts." in f".{name}"
            shape = list(param.shape)
            if expert:
                shape[0] //= layout["ep"]
            axis, shards = (1, expert_shards) if expert else (0, dense_shards)
            whole = math.prod(shape)
            counts["local"] += whole // shape[axis] * math.ceil(shape[axis] / shards) if shards > 1 else whole
            total += whole
        counts["gathered"] = max(counts["gathered"], total)
        counts["fp8"] += fp8_elements(layer, compiled, layout["ep"])
    in_layers = {id(p) for layer in model.model.layers.values() for p in layer.parameters()}
    for param in model.parameters():
        if id(param) not in in_layers:
            counts["root"] += param.numel()
            counts["local"] += param.numel() // param.shape[0] * math.ceil(param.shape[0] / dense_shards)
    return counts


def fp8_elements(layer: torch.nn.Module, compiled: bool, ep: int) -> list[int]:
    """The elements of each of a decoder layer's weights that --fp8 quantizes (use_fp8: its experts' stacks and its
    Linear modules' weights), unsharded; not the Linears of a compiled stage (compile_stages: an MoE layer's
    attention_stage, which runs all but its mlp's, and a dense layer whole), which compute in the compute dtype."""
    counts = []
    for name, module in layer.named_modules():
        if isinstance(module, LocalExperts):
            counts += [param.numel() // ep for param in module.parameters() if param.dim() == 3]
        elif isinstance(module, Linear) and not (compiled and not (layer.is_moe and name.startswith("mlp."))):
            counts.append(module.weight.numel())
    return counts


BUILT = {}   # (family, config, held layers) -> the model on the meta device


def meta_model(family: str, cfg, held: tuple[int, ...]) -> torch.nn.Module:
    """The model of a pipeline rank holding `held` layers, on the meta device; built once per (family, config,
    layers) for plan-layout, which estimates many layouts of one model."""
    key = (family, repr(cfg), held)
    if key not in BUILT:
        with torch.device("meta"):
            BUILT[key] = MODELS[family][1](cfg, held_layers=list(held))
    return BUILT[key]


def estimate(args) -> list[dict]:
    """One row of bytes per pipeline rank for the run `args` (pith-train's flags; --device cuda is taken as planned
    even where torch sees no GPU); ConfigError or LayoutError as the app would give them."""
    check_args(argparse.Namespace(**vars(args) | dict(device="cpu", cuda_graph=None)))
    cfg, hf = model_config(args), hf_config_data(args)
    plan = Parallel(args.pp, args.dp, args.cp, args.ep)
    check_layout(args, plan)
    layout = dict(pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep)
    device = torch.device(args.device)
    width = compute_dtype(args, device).itemsize
    compiled = args.compile if args.compile is not None else device.type == "cuda" and args.cp == 1
    micro_batches, tokens = micro_batches_per_rank(args, plan), micro_batch_size(args, plan) * args.seq_len // args.cp
    sizes = args.chunk_layers and [int(n) for n in args.chunk_layers.split(",")]
    chunks = chunk_layers(cfg.num_hidden_layers, args.pp, sizes) if args.pp > 1 else [range(cfg.num_hidden_layers)] * 2
    rows = []
    for rank in range(args.pp):
        held = held_layers(chunks, rank) if args.pp > 1 else list(chunks[0])
        model = meta_model(args.model, cfg, tuple(held))
        plan.check_model(cfg.num_hidden_layers, moe_layers(model)[0].num_experts, args.seq_len)
        n = weight_elements(model, layout, compiled)
        per_layer = {layer: activations_per_token(hf, layer, width) for layer in held}
        # the head's inputs, and what the loss keeps from its forward to its backward: the last chunk's logits
        # (overwritten by their gradient) and, with several chunks, the earlier ones' weight-gradient sum
        loss_kept = width * cfg.vocab_size * (min(tokens, LOSS_CHUNK) + (tokens > LOSS_CHUNK) * hf["hidden_size"])
        head = width * 3 * hf["hidden_size"] + 4 + loss_kept / tokens if cfg.num_hidden_layers - 1 in held else 0
        phases = [[sum(per_layer[layer][part] for layer in chunks[c]) for part in (0, 1)]
                  for c in (rank, 2 * args.pp - 1 - rank)]
        phases[1][0] += head   # one process: both "phases" are the whole model
        row = dict(rank=rank, weights=4 * n["local"], gradients=4 * n["local"], optimizer=8 * n["local"],
                   activations=tokens * in_flight(args.pp, micro_batches, rank, phases),
                   fp8_cache=2 * sum(n["fp8"]) * args.fp8 * (not plan.sharded))
        if not plan.sharded:   # ComputeCasts: a copy of every weight held, kept for the step's micro-batches
            row["compute_copies"] = (width < 4) * width * n["local"]
            pairs = plan.world == 1 and micro_batches > 1   # (a pipeline's deferred ones are in_flight's)
            row["transient"] = pairs * tokens * sum(pair for _, pair in per_layer.values())
        else:   # FSDP2: the root and two layers gathered (one prefetched), a layer's fp32 gradient before its reduce
            row["compute_copies"] = width * (n["root"] + 2 * n["gathered"])
            # and under --fp8 both layouts of one weight, quantized at each use (Fp8WeightCache(keep=False))
            row["transient"] = 4 * n["gathered"] + 2 * max(n["fp8"], default=0) * args.fp8
        held_through = row["weights"] + row["optimizer"] + row["compute_copies"] + row["fp8_cache"]
        grads = row["gradients"] if micro_batches > 1 or plan.world > 1 else 0   # one micro-batch: they replace copies
        row["peak"] = max(row["weights"] + row["gradients"] + row["optimizer"],   # at the optimizer step
                          held_through + grads + row["activations"] + row["transient"])
        rows.append(row)
    return rows


COLUMNS = ("weights", "gradients", "optimizer", "compute_copies", "fp8_cache", "activations", "transient", "peak")


def table(rows: list[dict]) -> str:
    lines = ["pp rank | " + " | ".join(COLUMNS) + "   (GiB)"]
    lines += [f"{row['rank']} | " + " | ".join(f"{row[c] / GIB:.2f}" for c in COLUMNS) for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory", type=float, help="GiB per GPU: exit 1 when a rank's peak exceeds it")
    parser.add_argument("train", nargs=argparse.REMAINDER, help="-- then pith-train's model and flags")
    options = parser.parse_args(argv)
    try:
        rows = estimate(parse_args([a for a in options.train if a != "--"]))
    except (ConfigError, LayoutError) as err:
        print(f"estimate_memory: error: {err}", file=sys.stderr)
        return 2
    print(table(rows))
    peak = max(row["peak"] for row in rows)
    fits = options.gpu_memory is None or peak <= options.gpu_memory * GIB
    verdict = "" if options.gpu_memory is None else f"; {'fits' if fits else 'does NOT fit'} {options.gpu_memory:g} GiB"
    print(f"peak {peak / GIB:.2f} GiB per GPU (pipeline rank {max(rows, key=lambda r: r['peak'])['rank']}){verdict}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
