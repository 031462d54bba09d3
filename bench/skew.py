"""Skewed and even routing for bench/train_throughput.py (--routing skewed / even): both sides' routers changed alike,
and the expert loads each side measures.

Real routing is skewed. The benchmark's uniform random tokens at init route evenly only where a router's logits are
close to independent across tokens: the first MoE layer of each 4-layer cut, and every layer of DeepSeek-V2-Lite
(the heaviest expert 1.1-2.2x the mean); from the second layer on, Qwen3-30B-A3B and GPT-OSS-20B at init already
send 3-6x the mean to one expert (measured on an H100, bench/RESULTS.md). Skewed routing adds one fixed bias per
expert, the same in every MoE layer, to the router's logits on both sides, before the top-k (and before the softmax,
where the family takes it first): b_e = -s ln(1 + e), so expert e's softmax weight is scaled by (1 + e)^-s, a Zipf
profile with expert 0 the heaviest. skew_bias picks s, deterministically from the preset alone, so that for router
logits drawn iid N(0, sigma^2) with sigma = initializer_range x sqrt(hidden_size) (an initial router row against a
normed input of RMS 1) the heaviest expert gets `target` (default 4) times the mean load: what it gives where the
logits are near that (the first MoE layer: 3.7-4.1x), on top of any imbalance of the init's own deeper in. The bias
is the same tensor on both sides; what the routing then does is measured, not assumed (load_stats): each step's
slots per expert in each MoE layer, the max over the mean, averaged over layers and steps, recorded in each row,
balanced rows included.

Even routing is the other extreme: token t of a micro-batch goes to experts (t k + j) mod E, j < k (k experts a token
of E), its weights the router's own on those; every expert gets exactly tokens x k / E slots (tokens x k a multiple
of E in the benchmark's shapes), a baseline with no load imbalance at all.

Ours: each MoE layer's LoadBalance.select sees scores routed as if b were in the logits (GPT-OSS hands it the logits,
the others the softmax, where softmax(l + b) = p e^b / sum(p e^b)); the load is the app's own count (train_step's
routing). transformers': a forward hook on each TopKRouter redoes its top-k on the biased logits, in the router's own
rule, and counts the chosen experts. Even: ours choose among only the k allowed experts (select's `allowed`);
transformers' redo the top-k with every other logit at -inf (even_logits).
"""
import math
import types

import torch

EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")   # Qwen3 / Qwen3.5, DeepSeek-V2, GPT-OSS


def experts_of(preset: dict) -> tuple[int, int]:
    """(routed experts, experts per token) of a preset (a Hugging Face config dict)."""
    return next(preset[key] for key in EXPERT_KEYS if preset.get(key)), preset["num_experts_per_tok"]


def zipf_bias(experts: int, exponent: float) -> torch.Tensor:
    return -exponent * torch.log1p(torch.arange(experts, dtype=torch.float64))


def simulated_ratio(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> float:
    """The heaviest expert's load over the mean when tokens with these logits [tokens, E] pick their top_k of
    logits + bias."""
    ids = (logits + bias).topk(top_k, dim=-1).indices.flatten()
    loads = torch.bincount(ids, minlength=logits.shape[1]).double()
    return (loads.max() / loads.mean()).item()


def skew_bias(preset: dict, target: float, tokens: int = 16384) -> torch.Tensor:
    """The per-expert logit bias [E] (fp32, CPU) of skewed routing for this preset: the Zipf exponent bisected, on one
    fixed draw of tokens x E normal logits (the same draw at every trial, so the ratio only grows with the exponent),
    until the heaviest expert's simulated load is target x the mean."""
    experts, top_k = experts_of(preset)
    if not 1 < target < experts / top_k:   # at E / k the heaviest expert is in every token's top-k
        raise ValueError(f"skew target {target} must lie between 1 and experts / top-k = {experts / top_k:g}")
    if preset.get("topk_method", "greedy") != "greedy":   # the transformers hook redoes greedy top-k only
        raise ValueError(f"skewed routing supports greedy top-k, not {preset['topk_method']}")
    sigma = preset["initializer_range"] * math.sqrt(preset["hidden_size"])
    logits = sigma * torch.randn(tokens, experts, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    low, high = 0.0, 1.0
    while simulated_ratio(logits, zipf_bias(experts, high), top_k) < target:
        low, high = high, 2 * high
    for _ in range(40):   # 40 halvings: the exponent to ~1e-12 of its bracket
        middle = (low + high) / 2
        low, high = (middle, high) if simulated_ratio(logits, zipf_bias(experts, middle), top_k) < target else \
            (low, middle)
    return zipf_bias(experts, high).float()


# ---- ours ----

def skewed_select(self, scores: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None):
    """LoadBalance.select on the scores a router gives when skew_bias is in its logits: one function for every layer,
    bound to each LoadBalance, so that the compiled stage 1 stays one code for all layers."""
    if self.skew_on_logits:
        scores = scores + self.skew_bias
    else:   # softmax scores: softmax(l + b) = p e^b / sum(p e^b), without a log of p
        scores = scores * self.skew_bias.exp()
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return type(self).select(self, scores, top_k, allowed)


def even_allowed(tokens: int, experts: int, top_k: int, device) -> torch.Tensor:
    """[tokens, E] bool: token t's experts (t k + j) mod E, j < k."""
    chosen = torch.arange(tokens * top_k, device=device).view(tokens, top_k) % experts
    return torch.zeros(tokens, experts, dtype=torch.bool, device=device).scatter_(1, chosen, True)


def even_select(self, scores: torch.Tensor, top_k: int, allowed: torch.Tensor | None = None):
    """LoadBalance.select with each token allowed only its even_allowed experts (a family's own mask is dropped)."""
    return type(self).select(self, scores, top_k, even_allowed(*scores.shape, top_k, scores.device))


def even_our_routers(model):
    """Every MoE layer of our model routes evenly (even_select). Before compile_stages, as skew_our_routers."""
    from pith_engine.contract import moe_layers
    for layer in moe_layers(model):
        layer.balance.select = types.MethodType(even_select, layer.balance)


def skew_our_routers(model, bias: torch.Tensor, on_logits: bool):
    """Every MoE layer of our model routes with `bias` added to its router logits (on_logits: the family hands
    LoadBalance.select its logits, GPT-OSS; else its softmax probabilities). Before compile_stages, which then
    traces skewed_select."""
    from pith_engine.contract import moe_layers
    for layer in moe_layers(model):
        layer.balance.skew_bias, layer.balance.skew_on_logits = bias.to(layer.balance.expert_load.device), on_logits
        layer.balance.select = types.MethodType(skewed_select, layer.balance)


# ---- transformers' ----

def hf_routers(model) -> list[torch.nn.Module]:
    """Each MoE layer's router, in layer order: transformers 5's Qwen3MoeTopKRouter, DeepseekV2TopkRouter,
    GptOssTopKRouter, Qwen3_5MoeTopKRouter, whose forward returns (logits, top-k weights, top-k expert ids)."""
    return [module for module in model.modules() if type(module).__name__.lower().endswith("topkrouter")]


def hf_route(router, logits: torch.Tensor):
    """(top-k weights, expert ids) by the router's own rule (its forward after the logits): GPT-OSS the softmax of the
    top-k logits; the others the top-k of the softmax, renormalized (Qwen3.5 always, Qwen3 under norm_topk_prob),
    times routed_scaling_factor (DeepSeek-V2)."""
    name = type(router).__name__
    if name.startswith("GptOss"):
        top, ids = logits.topk(router.top_k, dim=-1)
        return top.softmax(dim=-1), ids
    top, ids = logits.softmax(dim=-1, dtype=torch.float32).topk(router.top_k, dim=-1)
    if name.startswith("Qwen3_5") or getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return top * getattr(router, "routed_scaling_factor", 1.0), ids


def skewed_logits(bias: torch.Tensor):
    """watch_hf_routers' reroute for skewed routing: the bias (on the routers' device) added to the logits."""
    return lambda router, logits: logits + bias


def even_logits(router, logits: torch.Tensor) -> torch.Tensor:
    """watch_hf_routers' reroute for even routing: every logit but even_allowed's at -inf."""
    return logits.masked_fill(~even_allowed(*logits.shape, router.top_k, logits.device), float("-inf"))


def watch_hf_routers(model, reroute=None):
    """Hooks each router of transformers' model to count its chosen experts, and with reroute(router, fp32 logits)
    -> logits (skewed_logits, even_logits) to route, by the router's own rule, as if those were its logits;
    -> loads(): the slots each layer's experts got since the last call, [MoE layers, E], counts zeroed."""
    routers = hf_routers(model)
    device = routers[0].weight.device
    counts = torch.zeros(len(routers), routers[0].num_experts, device=device)

    def hook(router, args, output, layer):
        logits, weights, ids = output
        if reroute is not None:
            logits = reroute(router, logits.float())
            new_weights, ids = hf_route(router, logits)
            output = (logits.to(output[0].dtype), new_weights.to(weights.dtype), ids)
        counts[layer].scatter_add_(0, ids.flatten(), torch.ones(ids.numel(), device=device))
        return output

    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda *call, layer=layer: hook(*call, layer=layer))

    def loads() -> torch.Tensor:
        seen = counts.clone()
        counts.zero_()
        return seen
    return loads


# ---- both ----

def load_stats(loads: list[torch.Tensor]) -> dict:
    """From each step's loads [MoE layers, E]: the heaviest expert's load over the mean, per layer averaged over
    the steps, and that averaged over layers."""
    ratios = torch.stack([step.amax(dim=-1) / step.mean(dim=-1) for step in loads]).mean(dim=0)
    return dict(load_max_mean=round(ratios.mean().item(), 3),
                load_max_mean_layers=[round(ratio, 3) for ratio in ratios.tolist()])
