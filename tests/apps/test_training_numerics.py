"""What a real run needs to train correctly: mixed precision (fp32 master weights, bf16 compute) on one
process, gradient accumulation that gives the gradient of the whole step with the aux losses on, aux-free
balancing that never picks a masked expert and keeps its fp32 state."""
import copy
import weakref

import pytest
import torch

from conftest import KERNEL_DEVICE, relative_error
from pith_apps.config import read_json
from pith_apps.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from pith_apps.options import MODELS, PRESETS, check_args, model_config, parse_args
from pith_apps.train import build_model, layout, train_step
from pith_engine.data_parallel import (add_grads_in_kernels, embedding, keep_compute_copies, shard_model,
                                       version_of)
from pith_engine.moe import LoadBalance, update_expert_bias
from pith_engine.optim import adamw
from pith_engine.parallel import Parallel
from pith_ops.grouped_gemm import WgradPairs, grouped_linear

BATCH, SEQ = 4, 16


def tiny(family, balance=None, micro_batches=1, **overrides):
    config_cls, model_cls = MODELS[family]
    cfg = config_cls.from_dict(read_json(PRESETS / f"{family}_tiny.json") | {"initializer_range": 0.2} | overrides)
    model = model_cls(cfg, Parallel(), **({"balance": balance} if balance else {}), micro_batches=micro_batches)
    model.init_weights(seed=1)
    return model


def batch(vocab, rows=BATCH, seed=5):
    ids = torch.randint(0, vocab, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def gradients(model):
    return {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("family", list(MODELS))
def test_one_process_computes_in_bf16_with_fp32_master_weights_and_gradients(family):
    """The same forward and backward as the model cast to bf16, bit for bit, but weights and gradients stay fp32,
    so an update far below half a bf16 step of the weight still lands."""
    mixed = tiny(family)
    pure = copy.deepcopy(mixed).to(torch.bfloat16)
    shard_model(mixed, Parallel(), param_dtype=torch.bfloat16)
    ids, labels = batch(mixed.config.vocab_size)
    losses = [model.loss_sum(ids, labels) / labels.numel() for model in (mixed, pure)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() == losses[1].item()
    for (name, master), low in zip(mixed.named_parameters(), pure.parameters()):
        assert master.dtype == master.grad.dtype == torch.float32, name
        assert torch.equal(master.grad, low.grad.float()), name
    before = [p.detach().clone() for p in mixed.parameters()]
    optimizer = adamw(mixed, lr=1e-5, weight_decay=0.0)   # 1e-5: ~1/400 of a bf16 step at 0.2
    optimizer.step()
    for (name, param), old in zip(mixed.named_parameters(), before):
        # Adam's first step moves an element by lr * |g| / (|g| + eps), lr where |g| > 1e-6; 2.5e-7: fp32 rounding
        # of weights up to ~2 (in bf16 the move would be 0 or a whole bf16 step, >= 1e-3 there)
        moved = (param.detach() - old).abs()[param.grad.abs() > 1e-6]
        assert moved.numel() == 0 or (moved - 1e-5).abs().max().item() < 2.5e-7, name


def test_weight_decay_spares_every_familys_norms_and_biases_the_expert_stacks_included():
    """GPT-OSS's experts' biases are [E, n] stacks: no decay, as the 1-d biases and norms."""
    for family in MODELS:
        model = tiny(family)
        decay, no_decay = adamw(model, lr=1e-3, weight_decay=0.1).param_groups
        names = {id(p): name for name, p in model.named_parameters()}
        spared = {names[id(p)] for p in no_decay["params"]}
        assert all(p.ndim >= 2 for p in decay["params"]) and all(
            p.ndim == 1 or names[id(p)].endswith("bias") for p in no_decay["params"]), family
        assert len(decay["params"]) + len(spared) == len(names)
        if family == "gpt_oss":
            assert {f"model.layers.0.mlp.experts.{n}_proj_bias" for n in ("gate_up", "down")} <= spared


def test_one_process_casts_once_per_step_and_adds_each_micro_batch_into_the_fp32_gradient():
    """The bf16 copies are made once per optimizer step and reused by its micro-batches (never stale after
    the update), and the fp32 gradient is the fp32 sum of the bf16 model's micro-batch gradients, bit for bit."""
    mixed = tiny("qwen3")
    pure = copy.deepcopy(mixed).to(torch.bfloat16)
    shard_model(mixed, Parallel(), param_dtype=torch.bfloat16)
    seen = []   # the embedding weight each forward computes with
    mixed.model.embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(module.weight))
    sums = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in pure.named_parameters()}
    for seed in range(3):
        ids, labels = batch(mixed.config.vocab_size, seed=seed)
        (mixed.loss_sum(ids, labels) / labels.numel()).backward()
        (pure.loss_sum(ids, labels) / labels.numel()).backward()
        for name, param in pure.named_parameters():
            sums[name] += param.grad.float()
        pure.zero_grad(set_to_none=True)
    for name, param in mixed.named_parameters():
        assert torch.equal(param.grad, sums[name]), name
    assert len({w.data_ptr() for w in seen}) == 1 and seen[0].dtype == torch.bfloat16
    # fused, as on CUDA: it writes the weights without bumping their version counters
    torch.optim.AdamW(mixed.parameters(), lr=1e-2, fused=True).step()
    mixed.loss_sum(*batch(mixed.config.vocab_size))
    assert torch.equal(seen[-1], mixed.model.embed_tokens.weight.detach().to(torch.bfloat16))
    assert not torch.equal(seen[-1], seen[0])


def app_model(micro_batches):
    args = parse_args(["qwen3", "--preset", "tiny", "--batch-size", str(micro_batches), "--micro-batch-size", "1",
                       "--seq-len", str(SEQ), "--device", "cpu", "--save-every", "0", "--dtype", "bfloat16"])
    check_args(args)
    parallel, device = layout(args)
    model = build_model(MODELS["qwen3"][1], model_config(args), parallel, device, torch.bfloat16, 0, SEQ,
                        micro_batches=micro_batches)
    return args, parallel, device, model


def test_a_one_micro_batch_step_drops_the_bf16_copies_before_its_backward():
    """So that the backward frees each copy after its layer: held, they add the bf16 size of every weight to the
    step's peak memory (with one micro-batch the gradients are made in that backward)."""
    args, parallel, device, model = app_model(1)
    kept, freed = [], []   # copies held during the backward; copies alive after the step
    model.model.norm.register_full_backward_pre_hook(lambda module, grad: kept.append(len(model.compute_casts.copies)))
    model.register_forward_hook(lambda module, args, out: freed.extend(
        weakref.ref(c) for _, c in model.compute_casts.copies.values()))
    train_step(args, parallel, device, model, adamw(model, 1e-3, 0.0), 1, *batch(model.config.vocab_size, rows=1),
               False)
    assert kept == [0]
    assert freed and all(ref() is None for ref in freed)


def test_with_several_micro_batches_the_kernel_step_writes_the_kept_bf16_copies_and_no_forward_casts():
    """keep_compute_copies (the app's one-process steps of several micro-batches): the copies stay in their memory
    from step to step, AdamW's kernel writes each as it updates its parameter (its bf16 cast: the kernel test
    checks the rounding), and the next step's forwards cast none; after an update that does not write them (torch's AdamW, as for
    Muon's matrices) the next forward casts them again, in place. The experts pair their weight gradients through the step's WgradPairs."""
    args, parallel, device, model = app_model(2)
    assert all(layer.mlp.experts.wgrad_pairs is model.wgrad_pairs is not None for layer in model.layers.values()
               if layer.is_moe)
    optimizer = adamw(model, 1e-3, 0.0)
    optimizer.use_kernel = True   # as on CUDA
    keep_compute_copies(model, optimizer)
    casts, computed = [], model.compute_casts

    def counting_copy_of(param, copy_of=computed.copy_of):   # whether each copy asked for is cast first
        casts.append(computed.copies.get(id(param), [None])[0] != version_of(param))
        return copy_of(param)
    computed.copy_of = counting_copy_of
    held = {}
    for step in (1, 2, 3):
        optimizer.use_kernel = step != 2   # torch's fused AdamW, which leaves the copies to the next forward
        train_step(args, parallel, device, model, optimizer, step, *batch(model.config.vocab_size, rows=2, seed=step),
                   False)
        for param in model.parameters():
            copy = model.compute_casts.copies[id(param)][1]
            if step != 2:   # the cast, but for Triton's CPU interpreter, which truncates to bf16: within one bf16 step
                assert ((param.detach() - copy.float()).abs() <= param.detach().abs() * 2 ** -7).all()
            assert held.setdefault(id(param), copy.data_ptr()) == copy.data_ptr()
    params = len(list(model.parameters()))
    # cast by step 1's first forward and (in place) by step 3's, after torch's AdamW: by no other
    assert casts == [True] * params + [False] * params * 3 + [True] * params + [False] * params


class Experts(torch.nn.Module):
    def __init__(self, experts, out, inp):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, out, inp, device=KERNEL_DEVICE))
        self.wgrad_pairs = None

    def forward(self, x, tokens_per_expert):
        return grouped_linear(x, self.weight, tokens_per_expert, wgrad_pairs=self.wgrad_pairs, use_triton=True)


def three_micro_batches(experts, after_each=lambda index, expected: None) -> torch.Tensor:
    """Backward of 3 micro-batches through the experts; returns the float64 sum of their weight gradients.
    after_each(index, sum so far) runs after each micro-batch's backward."""
    torch.manual_seed(3)
    counts = torch.tensor([17, 0, 70, 1], device=KERNEL_DEVICE)   # an idle expert; 70 rows: two row blocks
    expected = torch.zeros(4, 130, 24, dtype=torch.float64)
    for index in range(3):
        x = torch.randn(88, 24, device=KERNEL_DEVICE).bfloat16()
        grad = torch.randn(88, 130, device=KERNEL_DEVICE).bfloat16()
        experts(x, counts).backward(grad)
        for e, rows in enumerate(torch.split(torch.arange(88), counts.tolist())):
            expected[e] += grad[rows].double().T @ x[rows].double()
        after_each(index, expected)
    return expected


def test_one_process_expert_weight_gradient_is_summed_in_fp32_straight_into_the_master_gradient():
    """On CUDA the grouped weight-gradient kernel adds each micro-batch's gradient of a bf16 copy straight into
    the fp32 master's .grad (summed in fp32, never rounded to bf16) and autograd adds nothing more."""
    experts = shard_model(Experts(4, 130, 24), Parallel(), param_dtype=torch.bfloat16)   # 130: a partial tile
    expected = three_micro_batches(experts)
    assert experts.weight.grad.dtype == torch.float32
    # exact bf16 products, fp32 sums of 70 and of 3 terms: ~1e-7; a bf16 rounding per micro-batch would be ~1e-3
    assert relative_error(experts.weight.grad, expected) < 1e-6
    assert torch.equal(experts.weight.grad[1], torch.zeros(130, 24, device=KERNEL_DEVICE))


def test_a_bf16_model_adds_each_micro_batch_expert_weight_gradient_into_its_grad_inside_the_kernel(monkeypatch):
    """The pure-bf16 step (add_grads_in_kernels): the kernel sums a micro-batch in fp32 and adds it to the bf16
    .grad with one rounding; no separate weight gradient is made and autograd adds nothing more."""
    import pith_ops.grouped_gemm as grouped_gemm
    monkeypatch.setattr(grouped_gemm, "grouped_wgrad", None)   # the path that writes a gradient, then adds it
    experts = Experts(4, 130, 24).to(torch.bfloat16)
    add_grads_in_kernels(experts)
    expected = three_micro_batches(experts)
    assert experts.weight.grad.dtype == torch.bfloat16
    # a rounding to bf16 is at most 2^-9 (2e-3) relative: three stay below 1e-2; a doubled gradient would be off by 1
    assert relative_error(experts.weight.grad, expected) < 1e-2
    assert torch.equal(experts.weight.grad[1], torch.zeros(130, 24, dtype=torch.bfloat16, device=KERNEL_DEVICE))


def test_paired_micro_batches_add_their_expert_weight_gradients_into_the_master_gradient_in_one_pass():
    """WgradPairs: the first micro-batch's weight gradient waits (nothing in .grad yet), the second's backward
    adds both in one pass of the kernel, the third waits until flush; the sum is the same fp32 sum as one
    micro-batch at a time."""
    experts = shard_model(Experts(4, 130, 24), Parallel(), param_dtype=torch.bfloat16)
    experts.wgrad_pairs = pairs = WgradPairs()
    seen = []

    def after_each(index, expected):
        grad = experts.weight.grad
        seen.append((len(pairs.waiting), None if grad is None else relative_error(grad, expected)))
    expected = three_micro_batches(experts, after_each)
    assert seen[0] == (1, None) and seen[1][0] == 0 and seen[2][0] == 1
    assert seen[1][1] < 1e-6   # the pair's sum, in .grad after the second micro-batch
    pairs.flush()
    assert not pairs.waiting and relative_error(experts.weight.grad, expected) < 1e-6
    assert torch.equal(experts.weight.grad[1], torch.zeros(130, 24, device=KERNEL_DEVICE))


class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(50, 8))

    def forward(self, ids):
        return embedding(ids, self.weight, fused=True)


def test_one_process_embedding_gradient_goes_row_by_row_into_the_fp32_master_gradient():
    """As on CUDA: the rows of the bf16 copy forward; backward adds each token's gradient row into the fp32
    master's .grad (repeated tokens summed in fp32), no dense bf16 gradient, nothing more through autograd."""
    torch.manual_seed(4)
    lookup = shard_model(Lookup(), Parallel(), param_dtype=torch.bfloat16)
    ids = torch.tensor([[3, 7, 3, 3], [0, 7, 49, 3]])
    expected = torch.zeros(50, 8, dtype=torch.float64)
    for _ in range(2):
        out = lookup(ids)
        assert torch.equal(out, lookup.weight.detach().bfloat16()[ids])
        grad = torch.randn(2, 4, 8).bfloat16()
        out.backward(grad)
        expected.index_add_(0, ids.flatten(), grad.reshape(-1, 8).double())
    assert lookup.weight.grad.dtype == torch.float32
    assert relative_error(lookup.weight.grad, expected) < 1e-7   # 8 bf16 terms summed in fp32: exact here
    assert not lookup.weight.grad[[1, 2, 48]].any()


def test_one_process_mixed_precision_restores_the_master_weights_after_a_failed_forward():
    model = tiny("qwen3")
    shard_model(model, Parallel(), param_dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        model.loss_sum(torch.full((1, 4), 10_000), torch.zeros(1, 4, dtype=torch.long))   # token id out of range
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in model.parameters())


def reference_aux(records, mode, rows_per_micro_batch, coef, scale):
    """The step's aux loss from each layer's router probabilities, written out: coef * scale * sum_e f_e P_e
    averaged over the balancing units (each sequence, or each micro-batch's rows)."""
    total = 0
    for probs, expert_ids in records:
        per_unit = SEQ if mode == "sequence" else SEQ * rows_per_micro_batch
        unit_losses = []
        for start in range(0, probs.shape[0], per_unit):
            p, ids = probs[start:start + per_unit], expert_ids[start:start + per_unit]
            f = torch.zeros(probs.shape[1]).scatter_add_(0, ids.flatten(), torch.ones(ids.numel())) / per_unit
            unit_losses.append((f * p.mean(0)).sum())
        total = total + coef * scale * torch.stack(unit_losses).mean()
    return total


@pytest.mark.parametrize("family,mode", [("qwen3", "global_batch"), ("qwen3", "micro_batch"), ("qwen3", "sequence"),
                                         ("deepseek_v2", "sequence"), ("gpt_oss", "global_batch")])
def test_accumulated_micro_batches_give_the_gradient_of_the_whole_step(family, mode):
    """k = 2 micro-batches, each loss / all tokens of the step, against one backward of the whole batch with
    the step's loss written out: cross-entropy mean plus, per MoE layer, the aux loss averaged over the step's
    units. float32; only summation order differs: 1e-5."""
    micro = 2
    model = tiny(family, mode, micro_batches=micro)
    reference = copy.deepcopy(model)
    ids, labels = batch(model.config.vocab_size)
    rows = BATCH // micro
    for start in range(0, BATCH, rows):
        (model.loss_sum(ids[start:start + rows], labels[start:start + rows]) / labels.numel()).backward()

    records = []
    for layer in reference.layers.values():
        if layer.is_moe:
            balance = layer.balance
            balance.attach_loss = lambda hidden, probs, expert_ids, sequences: records.append((probs, expert_ids)) or hidden
    ce = reference.loss_sum(ids, labels) / labels.numel()
    (ce + reference_aux(records, mode, rows, balance.coef, balance.scale)).backward()
    assert records and balance.coef > 0
    expected = gradients(reference)
    for name, grad in gradients(model).items():
        assert relative_error(grad, expected[name]) < 1e-5, name


def whole_and_split(family, balance):
    """One batch of BATCH sequences and the same batch as BATCH micro-batches of one, each backward run;
    asserts their gradients agree (1e-5, float32) and returns both models."""
    whole = tiny(family, balance)
    split = tiny(family, balance, micro_batches=BATCH)
    ids, labels = batch(whole.config.vocab_size)
    (whole.loss_sum(ids, labels) / labels.numel()).backward()
    for row in range(BATCH):
        (split.loss_sum(ids[row:row + 1], labels[row:row + 1]) / labels.numel()).backward()
    expected = gradients(whole)
    for name, grad in gradients(split).items():
        assert relative_error(grad, expected[name]) < 1e-5, name
    return whole, split


def test_sequence_balancing_is_the_same_for_any_split_of_the_step():
    """With one balancing unit per sequence the step's loss does not depend on the split: 4 micro-batches of
    one sequence give the gradient of one batch of four, the aux loss included (1e-5, float32)."""
    whole_and_split("qwen3", "sequence")


def test_aux_free_counts_every_micro_batch_of_the_step():
    """aux_free attaches no loss: 4 micro-batches of one sequence give the one-batch gradient (1e-5, float32)
    and, as their loads add up before the step's bias update, exactly the one-batch biases."""
    whole, split = whole_and_split("deepseek_v2", "aux_free")
    update_expert_bias(whole)
    update_expert_bias(split)
    biases = [[b for n, b in model.named_buffers() if n.endswith("expert_bias")] for model in (whole, split)]
    assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(*biases))


def group_limited_config():
    data = read_json(PRESETS / "deepseek_v2_tiny.json")
    return DeepseekV2Config.from_dict(data | {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                              "n_routed_experts": 8, "num_experts_per_tok": 2})


def test_aux_free_bias_never_routes_to_an_expert_of_a_masked_group():
    model = DeepseekV2ForCausalLM(group_limited_config(), balance="aux_free")
    layer = next(layer for layer in model.layers.values() if layer.is_moe)
    scores = torch.softmax(torch.randn(512, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    layer.balance.expert_bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0]))   # group 0 made most attractive
    expert_ids, weights = layer.route(scores)
    best_groups = scores.view(512, 4, 2).amax(-1).topk(2, dim=-1).indices            # the allowed groups
    assert (expert_ids // 2 == best_groups[:, :1]).logical_or(expert_ids // 2 == best_groups[:, 1:]).all()
    assert (expert_ids < 2).any()   # where group 0 is allowed, the bias does pick it
    assert torch.equal(weights, scores.gather(1, expert_ids) * model.config.routed_scaling_factor)


def test_aux_free_bias_moves_by_exactly_bias_rate_every_step_in_a_long_run():
    """Even after a cast of the model to bf16 the balancing state stays fp32: the load counts past 256, and over
    1,000 steps the overloaded expert's bias falls by bias_rate each step and the others' rise (in bf16 a bias
    stalls at 0.5, where half a bf16 step exceeds 1e-3). fp32 rounding over 1,000 adds: 1e-5."""
    balance = torch.nn.Sequential(LoadBalance(4, "aux_free", coef=0.0, scale=4, bias_rate=1e-3)).to(torch.bfloat16)[0]
    scores = torch.tensor([[5.0, 0.0, 0.0, 0.0]] * 300)   # expert 0 wins every token while 5 - bias gap > 0
    for step in range(1, 1001):
        balance.attach_loss(scores, scores, balance.select(scores, 1)[0], 1)
        assert balance.expert_load.tolist() == [300, 0, 0, 0]
        update_expert_bias(balance)
        if step % 100 == 0:
            expected = torch.tensor([-1.0, 1.0, 1.0, 1.0]) * 1e-3 * step
            assert (balance.expert_bias - expected).abs().max().item() < 1e-5, step
    assert balance.expert_bias.dtype == balance.expert_load.dtype == torch.float32
