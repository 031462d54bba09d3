"""Each pipeline rank's memory for a pith-train run on its layout: weights, gradients, optimizer state, compute
copies, FP8 cache, activations and transients, and the peak they add up to.

  hatch run apps:python skills/pith-apps/estimate-memory/estimate_memory.py [--gpu-memory GIB] -- qwen3 --preset 30b-a3b \
      --seq-len 4096 --batch-size 64 --micro-batch-size 1 --dp 8 --ep 8 [any other flag of pith-train]

The weights are counted exactly from the model built on the meta device, each rank's part as the app shards it:
experts split over ep, then over dp x cp (FSDP2; under --dp-replicate R, dp / R), every other weight over dp x cp x ep
(dp / R), a pipeline rank holding its
two DualPipeV chunks (rank 0 also the embedding, final norm and LM head). Activations are per token, per layer, of
what the CUDA path keeps for the backward under the run's --recompute (activations_per_token), a cp rank's own
tokens, times the micro-batches in flight: one without a pipeline, with one the most that the rank's DualPipeV
schedule holds at once (in_flight); a recompute adds, as a transient, what one layer's backward makes again; under
--optimizer muon its step adds its working set (muon_step_bytes). Prints a table and the peak; with --gpu-memory,
exits 1 when a rank's peak does not fit.
"""
import argparse
import math
import sys
from typing import NamedTuple

import torch

import pith_engine.muon as muon_engine
from pith_apps.config import ConfigError, qwen3_5_layer_types
from pith_apps.models.layers import Linear, LocalExperts, hidden_matrices
from pith_apps.options import MODELS, check_args, hf_config_data, model_config, parse_args
from pith_apps.train import check_layout, compute_dtype, micro_batch_size, micro_batches_per_rank
from pith_engine.contract import moe_layers
from pith_engine.dualpipev import chunk_layers, held_layers, schedule
from pith_engine.parallel import LayoutError, Parallel

GIB = 2**30
LOSS_CHUNK = 4096   # tokens per chunk of pith_ops.cross_entropy.linear_cross_entropy


def activations_per_token(hf: dict, layer: int, width: int, mode: str = "none", cp: int = 1,
                          ep: int = 1) -> tuple[float, float, float]:
    """(bytes a token leaves in decoder layer `layer` for the backward under --recompute `mode`, of them the experts'
    weight-gradient inputs that a paired or deferred weight gradient keeps longer (recomputed first, under a
    recompute), the bytes the layer's recompute makes again during its backward), computing in `width`-byte floats,
    a cp rank's own tokens. none: every stage keeps what its backward reads (stage_one; the router's fp32
    probabilities; per routed slot the expert input, the gate/up output, the activation and the expert output the
    combine weighs; a shared expert's gate, up and product). full: each region (pith_engine.recompute) keeps its
    inputs alone: the layer's input, the rows the experts receive and the routing, and the tokens where a shared
    expert's region holds them. selective: those and the outputs of the GEMMs and attention kernels
    (recompute.PRODUCTS). Under --ep a token's rows go to distinct_ranks ranks, and every mode keeps the exchange's
    indices."""
    h = hf["hidden_size"]
    attention, products = stage_one(hf, layer, width, cp)
    if hf["model_type"] == "deepseek_v2" and hf["first_k_dense_replace"] > layer:   # one region: its input kept
        none = attention + width * 3 * hf["intermediate_size"]   # the MLP's gate and up outputs and their product
        kept = dict(none=none, selective=width * (2 * h + 2 * hf["intermediate_size"]) + products, full=width * h)[mode]
        return kept, 0.0, none - kept
    experts, top_k, inner, shared, router = moe_shape(hf, width)
    ranks = distinct_ranks(experts, top_k, ep)
    routing = ranks * top_k * (width + 16)   # per row received: weights, and each slot's place in expert order, back
    if ep > 1:   # the (token, rank) pairs' indices and unit weights (the rows back are summed keeping none)
        routing += (8 + width) * ep + ranks * (16 + top_k)
    wgrad_inputs = width * top_k * (2 * h + 3 * inner)   # expert input and output gradient; gate/up grad, activation
    none = attention + wgrad_inputs + 4 * experts + width * 3 * shared + routing
    if mode == "none":
        return none, wgrad_inputs, 0.0
    # the layer's input; the tokens (on one process the experts' rows; a shared expert's region holds them too); the
    # rows the experts received under --ep
    rows = 1 + (ep == 1 or shared > 0) + ranks * (ep > 1)
    kept = width * h * rows + routing
    if mode == "selective":   # the router's scores, the experts' gate/up and down, a shared expert's three
        kept += products + router * experts + width * top_k * (2 * inner + h) + width * (2 * shared + h) * (shared > 0)
        kept += width * (hf["model_type"] == "qwen3_5_moe_text")   # its shared expert's gate
    return kept, wgrad_inputs, none - kept


def stage_one(hf: dict, layer: int, width: int, cp: int) -> tuple[float, float]:
    """(bytes per token stage 1 keeps without recompute: the norms' inputs and outputs, q, k, v and the attention
    output with its fp32 log-sum-exp, what the q/k norms and MLA's latent keep; of its products the bytes selective
    keeps: the projections' GEMM outputs and, at cp 1, SDPA's output and log-sum-exp). flex_attention (GPT-OSS's
    sinks) and ring attention (--cp) are not products: selective runs them again. Under --cp the ring keeps a
    rank's own q, k and v (DeepSeek-V2: its latent and rope key, expanded again in the backward), output and
    log-sum-exp; but each block's expansion, a GEMM, runs inside the region, so selective keeps cp of them."""
    h, heads, family = hf["hidden_size"], hf["num_attention_heads"], hf["model_type"]
    if family == "qwen3_5_moe_text":
        return qwen3_5_stage_one(hf, layer, width, cp)
    if family == "deepseek_v2":
        nope, rope, v, rank = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["kv_lora_rank"]
        q_lora, expanded, qk = hf.get("q_lora_rank") or 0, heads * (nope + v), nope + rope
        attention = 2 * rank + rope + 2 * q_lora + heads * (qk + v)   # latent, normed; rope key; q_lora's; q; output
        attention += (expanded + heads * (qk + v)) * (cp == 1)   # kv_b_proj's output, each head's key and value
        gemms, kernel = q_lora + heads * qk + rank + rope + expanded * cp + h, heads * v
    else:
        kv, head_dim = hf["num_key_value_heads"], hf["head_dim"]
        norms = heads + kv if family == "qwen3_moe" else 0   # Qwen3's per-head q/k norms keep their inputs
        attention = head_dim * (2 * heads + 2 * kv + norms)
        gemms, kernel = head_dim * (heads + 2 * kv) + h, head_dim * heads * (family == "qwen3_moe")
    kernel_kept = (width * kernel + 4 * heads) * (kernel > 0 and cp == 1)
    return width * (attention + 4 * h) + 4 * heads, width * gemms + kernel_kept


def qwen3_5_stage_one(hf: dict, layer: int, width: int, cp: int) -> tuple[float, float]:
    """stage_one of a Qwen3.5-MoE layer: a full-attention layer's q, its gate, k, v, the output and the q/k norms'
    inputs; a linear-attention layer's q, k, v before and after the convolution, z, the rule's output and its norm,
    the fp32 q, k, v the chunked rule takes and its three chunk-by-chunk fp32 matrices per value head. Selective
    keeps the projections' outputs (and at cp 1 SDPA's output); the convolution and the delta rule run again."""
    h = hf["hidden_size"]
    if qwen3_5_layer_types(hf)[layer] == "full_attention":
        heads, kv, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        kernel = (width * heads * head_dim + 4 * heads) * (cp == 1)
        return width * (head_dim * (4 * heads + 3 * kv) + 4 * h), width * (head_dim * (2 * heads + 2 * kv) + h) + kernel
    v_heads, k_dim, v_dim = hf["linear_num_value_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    qkv = 2 * hf["linear_num_key_heads"] * k_dim + v_heads * v_dim
    rule = 4 * v_heads * (2 * k_dim + v_dim + 3 * 64)
    return width * (2 * qkv + 3 * v_heads * v_dim + 4 * h) + rule, width * (qkv + v_heads * v_dim + 2 * v_heads + h)


def moe_shape(hf: dict, width: int) -> tuple[int, int, int, int, int]:
    """(routed experts, top-k, an expert's width, the shared experts' width (0: none), the bytes of a router score:
    DeepSeek-V2 routes in fp32, the others in the compute dtype) of an MoE layer."""
    if hf["model_type"] == "deepseek_v2":
        inner = hf["moe_intermediate_size"]
        return hf["n_routed_experts"], hf["num_experts_per_tok"], inner, hf["n_shared_experts"] * inner, 4
    experts = hf.get("num_experts") or hf["num_local_experts"]
    inner = hf["intermediate_size"] if hf["model_type"] == "gpt_oss" else hf["moe_intermediate_size"]
    return experts, hf["num_experts_per_tok"], inner, hf.get("shared_expert_intermediate_size", 0), width


def distinct_ranks(experts: int, top_k: int, ep: int) -> float:
    """How many of the ep ranks a token's top_k experts lie on (the (token, rank) rows dispatch sends per token), in
    expectation for experts drawn uniformly without repeats: balanced routing, as the estimate takes it."""
    if ep == 1:
        return 1.0
    return ep * (1 - math.comb(experts - experts // ep, top_k) / math.comb(experts, top_k))


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


def weight_elements(model: torch.nn.Module, layout: dict, compiled: bool, fp8: str | None) -> dict:
    """Per-rank element counts of the model's weights (built on meta for this pipeline rank): `local` what the
    rank keeps (the largest FSDP2 shard, as torch.chunk splits), of it `muon` that of the matrices --optimizer muon
    steps (hidden_matrices: one moment where AdamW keeps two), `gathered` the largest layer unsharded and `root`
    the rest unsharded (what FSDP2 gathers in the compute dtype), `fp8` the elements of each weight --fp8 `fp8`
    quantizes (none without it), unsharded (what the FP8 cache is given: the gathered weight); `whole` all of them
    unsharded (experts split over ep), `gathering` the most a layer's gather holds at once as FSDP2 does it (the
    weights, the gather's buffer where sharded, and an expert stack's row-sharded copy-out once more: another
    temporary), `owner` that of the largest module outside the layers (under --pp a root of its own)."""
    shards = layout["dp"] // layout.get("dp_replicate", 1)   # under HSDP a weight is sharded within a replica
    dense_shards, expert_shards = shards * layout["cp"] * layout["ep"], shards * layout["cp"]
    counts = dict(local=0, muon=0, gathered=0, root=0, fp8=[], whole=0, gathering=0, owner=0)
    muon = {id(p) for params in hidden_matrices(model).values() for p in params}
    for layer in model.model.layers.values():
        total = experts = 0
        for name, param in layer.named_parameters():
            expert = ".experts." in f".{name}"
            shape = list(param.shape)
            if expert:
                shape[0] //= layout["ep"]
            axis, shards = (1, expert_shards) if expert else (0, dense_shards)
            whole = math.prod(shape)
            local = whole // shape[axis] * math.ceil(shape[axis] / shards) if shards > 1 else whole
            counts["local"] += local
            counts["muon"] += local * (id(param) in muon)
            total += whole
            experts += whole * expert
        counts["gathered"] = max(counts["gathered"], total)
        counts["whole"] += total
        gathering = total + (total - experts) * (dense_shards > 1) + 2 * experts * (expert_shards > 1)
        counts["gathering"] = max(counts["gathering"], gathering)
        counts["fp8"] += fp8_elements(layer, compiled, layout["ep"], fp8 == "all") if fp8 else []
    in_layers = {id(p) for layer in model.model.layers.values() for p in layer.parameters()}
    for param in model.parameters():
        if id(param) not in in_layers:
            counts["root"] += param.numel()
            counts["local"] += param.numel() // param.shape[0] * math.ceil(param.shape[0] / dense_shards)
    counts["whole"] += counts["root"]
    for module in model.modules():
        owned = sum(p.numel() for p in module.parameters(False) if id(p) not in in_layers)
        counts["owner"] = max(counts["owner"], owned * (1 + (dense_shards > 1)))
    return counts


def fp8_elements(layer: torch.nn.Module, compiled: bool, ep: int, dense: bool) -> list[int]:
    """The elements of each of a decoder layer's weights that --fp8 quantizes (use_fp8: its experts' stacks and, dense
    (--fp8 all), its Linear modules' weights), unsharded; not the Linears of a compiled stage (compile_stages: an MoE
    layer's attention_stage, which runs all but its mlp's, and a dense layer whole), which quantize their weights at
    each use (pith_ops.fp8.traced_fp8_linear) and hold no blocks."""
    counts = []
    for name, module in layer.named_modules():
        if isinstance(module, LocalExperts):
            counts += [param.numel() // ep for param in module.parameters() if param.dim() == 3]
        elif dense and isinstance(module, Linear) and not (compiled and not (layer.is_moe and name.startswith("mlp."))):
            counts.append(module.weight.numel())
    return counts


class Stack(NamedTuple):
    """A parameter --optimizer muon steps, as a rank's optimizer holds it: `count` matrices [rows, columns] (a Linear's
    one, the rank's experts of a stack), orthogonalized whole or as halves (`split`), sharded by rows over a shard
    group of `ranks` (1: held whole)."""
    rows: int
    columns: int
    count: int
    split: str
    ranks: int

    @property
    def elements(self) -> int:
        """The whole matrices' elements (DTensor.numel(): what the bucket rule adds up)."""
        return self.count * self.rows * self.columns

    def local(self, rank: int = 0) -> int:
        """The elements of rank's rows (rank 0: the most, as torch.chunk splits)."""
        return self.count * muon_engine.row_counts(self.rows, self.ranks)[rank] * self.columns

    @property
    def gram(self) -> int:
        """The elements of the Gram matrices NS makes of them (of the shorter side of each matrix it orthogonalizes)."""
        pieces = 1 if self.split == "whole" else 2
        return self.count * pieces * min(self.rows // pieces, self.columns) ** 2


def muon_stacks(model: torch.nn.Module, ep: int, shards: int) -> list[Stack]:
    """The parameters Muon steps, in its order (hidden_matrices' splits, each split's parameters), on a rank of a
    layout whose weights are sharded over `shards` (dp x cp; a replica's, under HSDP) besides ep: the experts'
    stacks (3-d) split over ep, sharded over `shards`; the Linears' weights (2-d) over shards x ep."""
    return [Stack(*param.shape[-2:], math.prod(param.shape[:-2]) // (ep if param.ndim == 3 else 1), split,
                  shards * (1 if param.ndim == 3 else ep))
            for split, params in hidden_matrices(model).items() for param in params]


def muon_step_bytes(model: torch.nn.Module, layout: dict, cuda: bool) -> float:
    """The most bytes --optimizer muon's step (pith_engine.muon's muon_step) makes at once beyond the states, followed
    parameter by parameter in its order: on CUDA its Newton-Schulz iteration (NS) in bf16 and the momentum and update
    one kernel pass each; on CPU NS in fp32 and torch ops. Each parameter's momentum (momentum_bytes) makes its update
    in NS's dtype while the update before it is still referenced. One held whole is stepped at once (whole_bytes). A
    sharded one's update is held with its shard group's (dense matrices and expert stacks: one group where ep is 1,
    two otherwise) until their whole elements reach pith_engine.muon.BUCKET_ELEMENTS x the group's ranks: that bucket
    is then dealt out (flush_bytes) and let go; the groups' last buckets at the end, each held until the step ends."""
    width, shards = (2 if cuda else 4), layout["dp"] // layout.get("dp_replicate", 1) * layout["cp"]
    buckets, holding = {}, 0   # each shard group's Stacks held (by its ranks), and the bytes of all held
    peak, last = 0, 0   # last: the update before's bytes where no bucket holds it (muon_step's `update` still does)
    for stack in muon_stacks(model, layout["ep"], shards):
        n = stack.local()
        peak, last = max(peak, holding + last + momentum_bytes(n, cuda)), width * n
        if stack.ranks == 1:
            peak = max(peak, holding + whole_bytes(stack, width, cuda))
            continue
        bucket = buckets.setdefault(stack.ranks, [])
        bucket.append(stack)
        holding += width * n
        if sum(s.elements for s in bucket) >= muon_engine.BUCKET_ELEMENTS * stack.ranks:   # muon_step's rule
            peak = max(peak, holding + flush_bytes(buckets.pop(stack.ranks), width, cuda))
            holding -= width * sum(s.local() for s in bucket)
        else:
            last = 0
    return max([peak, *(holding + last + flush_bytes(bucket, width, cuda) for bucket in buckets.values())])


def momentum_bytes(n: int, cuda: bool) -> int:
    """momentum_update's most for n elements: the kernel's bf16 update, or the fp32 gradient over its scale (the
    update after), the moved buffer and the buffer chosen with torch.where."""
    return 2 * n if cuda else 12 * n


def apply_bytes(n: int, cuda: bool) -> int:
    """apply_update's temporaries for n elements: none for the kernel (in place); three fp32 terms of torch ops."""
    return 0 if cuda else 12 * n


def whole_bytes(stack: Stack, width: int, cuda: bool) -> float:
    """A parameter held whole: its update with NS's working set, or the update and NS's result as the weight moves."""
    n = stack.local()
    return max(ns_bytes(n, stack.gram, width), 2 * width * n + apply_bytes(n, cuda))


def flush_bytes(bucket: list[Stack], width: int, cuda: bool) -> float:
    """The most a bucket's turn (pith_engine.muon's step_sharded) makes on any rank beyond its updates: the whole
    matrices the rank owns (gathered) with what orthogonalizing them holds (each_bytes); or, as the results go back,
    them, the rows sent, the rows received and the rows placed; or, as each weight moves, every result with the
    weight's apply_bytes."""
    peak = 0
    for rank, batches in enumerate(dealt(bucket)):
        local, whole = sum(s.local(rank) for s in bucket), sum(s.elements for s in batches)
        apply = max(apply_bytes(s.local(rank), cuda) for s in bucket)
        peak = max(peak, width * whole + each_bytes(batches, width), width * 2 * (whole + local), width * local + apply)
    return peak


def dealt(bucket: list[Stack]) -> list[list[Stack]]:
    """Each rank's matrices of a bucket as pith_engine.muon.deal deals them, batched as orthogonalize_each batches
    them: one Stack (held whole) per shape and split, in the order they first come."""
    ranks = bucket[0].ranks
    owners = iter(muon_engine.deal(tuple(muon_engine.ns_cost(s.rows, s.columns, s.split) for s in bucket
                                         for _ in range(s.count)), ranks))
    owned = [{} for _ in range(ranks)]   # each rank's: how many matrices of each (rows, columns, split)
    for s in bucket:
        for _ in range(s.count):
            batches, shape = owned[next(owners)], (s.rows, s.columns, s.split)
            batches[shape] = batches.get(shape, 0) + 1
    return [[Stack(rows, columns, count, split, 1) for (rows, columns, split), count in batches.items()]
            for batches in owned]


def each_bytes(batches: list[Stack], width: int) -> float:
    """orthogonalize_each's most beyond the matrices it is given: the results of the batches done and the next
    batch's stack (with the one before's, not yet let go) or NS's working set on it."""
    peak = done = before = 0
    for s in batches:
        peak = max(peak, width * (done + before + s.elements), width * done + ns_bytes(s.elements, s.gram, width))
        done, before = done + s.elements, s.elements
    return peak


def ns_bytes(n: int, gram: int, width: int) -> float:
    """orthogonalize's most for a batch of n elements (its input included) whose Gram matrices hold `gram`, in
    `width`-byte floats: the input, the normalized x, the Gram matrix, the polynomial and the new x; or as the next
    Gram matrix or polynomial is made, the old one still held with x and both of the other's."""
    return width * max(3 * n + 2 * gram, 2 * n + 3 * gram)


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
    layout = dict(pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep, dp_replicate=args.dp_replicate)
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
        n = weight_elements(model, layout, compiled, args.fp8)
        per_layer = {layer: activations_per_token(hf, layer, width, args.recompute, args.cp, args.ep) for layer in held}
        # the head's inputs, and what the loss keeps from its forward to its backward: the last chunk's logits
        # (overwritten by their gradient) and, with several chunks, the earlier ones' weight-gradient sum
        loss_kept = width * cfg.vocab_size * (min(tokens, LOSS_CHUNK) + (tokens > LOSS_CHUNK) * hf["hidden_size"])
        head = width * 3 * hf["hidden_size"] + 4 + loss_kept / tokens if cfg.num_hidden_layers - 1 in held else 0
        phases = [[sum(per_layer[layer][part] for layer in chunks[c]) for part in (0, 1)]
                  for c in (rank, 2 * args.pp - 1 - rank)]
        phases[1][0] += head   # one process: both "phases" are the whole model
        muon = args.optimizer == "muon"
        moments = 8 * n["local"] - 4 * n["muon"] * muon   # AdamW's two, Muon's one
        row = dict(rank=rank, weights=4 * n["local"], gradients=4 * n["local"], optimizer=moments,
                   activations=tokens * in_flight(args.pp, micro_batches, rank, phases),
                   fp8_cache=2 * sum(n["fp8"]) * (not plan.sharded))
        if not plan.sharded:   # ComputeCasts: a copy of every weight held, kept for the step's micro-batches
            row["compute_copies"] = (width < 4) * width * n["local"]
            pairs = plan.world == 1 and micro_batches > 1   # (a pipeline's deferred ones are in_flight's)
            row["transient"] = pairs * tokens * sum(pair for _, pair, _ in per_layer.values())
        elif args.pp == 1:   # FSDP2: the root and two layers gathered (one prefetched), a layer's fp32 gradient before
            row["compute_copies"] = width * (n["root"] + 2 * n["gathered"])   # its reduce-scatter
            # and under --fp8 both layouts of one weight, quantized at each use (Fp8WeightCache(keep=False))
            row["transient"] = 4 * n["gathered"] + 2 * max(n["fp8"], default=0)
        else:   # FSDP2 under DualPipeV: each layer and owner a root, gathered for its forward or backward alone (the
            # next one's weights are prefetched once the gather's temporaries are gone); each side of a pair its own
            overlap = args.ep > 1 and args.overlap is not False
            row["compute_copies"] = width * (1 + overlap) * max(n["gathering"], n["owner"])
            row["gradients"] = 4 * n["whole"]   # held unsharded in fp32 through the step, reduce-scattered at its end
            # and a layer's gradient in the compute dtype before FSDP adds it into its fp32 sum
            row["transient"] = (width < 4) * width * n["gathered"] + 2 * max(n["fp8"], default=0)
        # and the backward of a recomputed layer holds what its recompute made again, one micro-batch's
        row["transient"] += tokens * max(again for _, _, again in per_layer.values())
        row["optimizer_step"] = muon_step_bytes(model, layout, device.type == "cuda") if muon else 0
        held_through = row["weights"] + row["optimizer"] + row["compute_copies"] + row["fp8_cache"]
        grads = row["gradients"] if micro_batches > 1 or plan.world > 1 else 0   # one micro-batch: they replace copies
        # the step's gradients are the weights' size (sharded alike); a pipeline's under FSDP unsharded before
        row["peak"] = max(2 * row["weights"] + row["optimizer"] + row["optimizer_step"],
                          held_through + grads + row["activations"] + row["transient"])
        rows.append(row)
    return rows


COLUMNS = ("weights", "gradients", "optimizer", "compute_copies", "fp8_cache", "activations", "transient",
           "optimizer_step", "peak")


def unit(peak: float) -> tuple[str, int]:
    """GiB, or MiB for a peak under 1 GiB (a tiny model's columns would all read 0.00 GiB)."""
    return ("GiB", GIB) if peak >= GIB else ("MiB", 2**20)


def table(rows: list[dict]) -> str:
    name, size = unit(max(row["peak"] for row in rows))
    lines = ["pp rank | " + " | ".join(COLUMNS) + f"   ({name})"]
    lines += [f"{row['rank']} | " + " | ".join(f"{row[c] / size:.2f}" for c in COLUMNS) for row in rows]
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
    name, size = unit(peak)
    print(f"peak {peak / size:.2f} {name} per GPU (pipeline rank {max(rows, key=lambda r: r['peak'])['rank']}){verdict}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
