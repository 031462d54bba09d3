"""Activation recompute (pith_engine.recompute): the gradients of every mode are those without recompute, what a
decoder layer keeps for its backward shrinks as the mode says, and no all-to-all runs twice; on one process (each
family, float32 and mixed precision, eager and compiled) and under ep 2, cp 2, dp 2 (FSDP) and pp 2 x ep 2."""
import functools

import pytest
import torch
import torch.distributed as dist

import pith_engine.recompute as recompute
from conftest import SavedBytes, relative_error
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine.compile import compile_stages
from pith_engine.context_parallel import zigzag_part
from pith_engine.contract import moe_layers
from pith_engine.data_parallel import ComputeCasts, local_part, shard_model
from pith_engine.dualpipev import Pipeline, chunk_layers, held_layers
from pith_engine.parallel import Parallel

MODES = ("selective", "full")


def tiny(family, parallel=Parallel(), mode="none", mixed=False, layers=None, held=None, micro_batches=1):
    config_cls, model_cls = MODELS[family]
    data = read_json(PRESETS / f"{family}_tiny.json") | {"initializer_range": 0.2, "router_aux_loss_coef": 0.1}
    if layers:
        data["num_hidden_layers"] = layers
    model = model_cls(config_cls.from_dict(data), parallel, micro_batches=micro_batches, held_layers=held)
    model.init_weights(seed=3)
    if parallel.sharded:
        shard_model(model, parallel, None)
    if mixed:
        ComputeCasts(torch.bfloat16).register(model)
    return recompute.recompute_stages(model, mode)


def batch(vocab, seq=32, rows=2, seed=1):
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def gradients(model, ids, labels):
    loss = model.loss_sum(ids, labels)
    loss.backward()
    return loss.detach(), [local_part(p.grad).clone() for p in model.parameters()]


def assert_same(got, expected, tolerance, what):
    assert relative_error(got[0], expected[0]) <= tolerance, (what, got[0], expected[0])
    for a, b in zip(got[1], expected[1]):
        assert a.shape == b.shape and (not b.numel() or relative_error(a, b) <= tolerance), what


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("family", list(MODELS))
def test_each_mode_gives_the_gradients_of_no_recompute(family, mixed):
    """The recomputed forward runs the same kernels on the same numbers (in mixed precision on the same bf16
    copies): the same loss and gradients, to 1e-6 (seen: equal)."""
    ids, labels = batch(256)
    expected = gradients(tiny(family, mixed=mixed), ids, labels)
    for mode in MODES:
        assert_same(gradients(tiny(family, mode=mode, mixed=mixed), ids, labels), expected, 1e-6, (family, mode))


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_each_mode_with_fp8_and_document_masks_gives_the_gradients_of_no_recompute(family):
    """--fp8 (emulated on CPU: each linear's and expert GEMM's operands quantized) and --doc-mask (documents ending
    at token 0): the recomputed forward quantizes and masks as the forward did, the same gradients to 1e-6."""
    from pith_apps.data import document_ids
    from pith_apps.models.layers import use_fp8
    from pith_ops.fp8 import Fp8WeightCache
    ids, labels = batch(256)
    ids[:, ::7] = 0
    docs = document_ids(ids, 0)

    def run(mode, fp8=True):
        model = tiny(family, mode=mode)
        if fp8:
            use_fp8(model, Fp8WeightCache(), dense=True)
        loss = model.loss_sum(ids, labels, docs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]
    expected = run("none")
    assert relative_error(expected[0], run("none", fp8=False)[0]) > 1e-4   # FP8 is on: it moves the loss (seen 2e-3)
    for mode in MODES:
        assert_same(run(mode), expected, 1e-6, (family, mode))


@pytest.mark.parametrize("family", list(MODELS))
def test_what_a_layer_keeps_for_its_backward_under_each_mode(family, monkeypatch):
    """One MoE layer, 2 x 256 tokens: full keeps its input, the tokens its experts receive and the routing (expert
    ids, weights, the sort's order and inverse, counts per expert), nothing more; selective keeps more than full
    and at most 0.7 x what no recompute keeps (seen 0.25-0.50); no recompute keeps over 8 x full (seen 11-26 x)."""
    kept = {}
    for mode in ("none", *MODES):
        saved = SavedBytes(monkeypatch)
        model = tiny(family, mode=mode)
        layer = moe_layers(model)[0]
        x = torch.randn(2, 256, model.config.hidden_size, requires_grad=True)
        args = model.layer_args(model.positions(torch.zeros(2, 256, dtype=torch.long), None), None, x.dtype)
        leave_out = [*model.parameters(), *(a for a in args if isinstance(a, torch.Tensor))]
        kept[mode] = saved.of(lambda: layer(x, *args), leave_out)
    with torch.no_grad():
        slots = layer.attention_stage(x, *args)[2].expert_ids.numel()
    # x and the tokens (fp32); per slot an expert id, a weight, its place in expert order and back; counts per expert
    bound = 2 * x.numel() * 4 + slots * (8 + 4 + 8 + 8) + layer.num_experts * 8
    assert kept["full"] <= bound, (kept, bound)
    assert kept["full"] < kept["selective"] <= 0.7 * kept["none"] and kept["none"] > 8 * kept["full"], kept


def counted_all_to_alls(monkeypatch_target, run):
    """(run(), how many all-to-alls it issued)."""
    calls, real = [], monkeypatch_target.all_to_all_single
    monkeypatch_target.all_to_all_single = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        return run(), len(calls)
    finally:
        monkeypatch_target.all_to_all_single = real


def layouts_body(rank, world):
    """ep 2, cp 2 and dp 2 (FSDP) on 2 processes, each family's own data per rank: each mode's loss and gradients are
    those without recompute (1e-6), with as many all-to-alls (forward and backward)."""
    for sizes in (dict(ep=2), dict(cp=2), dict(dp=2)):
        parallel = Parallel.build(**sizes)
        for family in ("qwen3", "deepseek_v2"):
            ids, labels = batch(256, seq=32, seed=1 + (rank if "cp" not in sizes else 0))
            if "cp" in sizes:
                ids, labels = (zigzag_part(t, 2, parallel.coords["cp"]) for t in (ids, labels))
            expected, count = counted_all_to_alls(dist, lambda: gradients(tiny(family, parallel), ids, labels))
            for mode in MODES:
                got, recomputed = counted_all_to_alls(
                    dist, lambda: gradients(tiny(family, parallel, mode), ids, labels))
                assert_same(got, expected, 1e-6, (sizes, family, mode))
                assert recomputed == count and (count > 0) == ("ep" in sizes), (sizes, family, mode, count, recomputed)


def test_each_mode_under_ep_cp_and_dp_gives_the_same_gradients_and_all_to_alls():
    run_on_processes(2, layouts_body)


def pipeline_body(rank, world):
    """pp 2 x ep 2, 4 micro-batches, weight gradients deferred to W steps and each pair's forward and backward in
    turns (the recompute runs in the backward's turn): the gradients of the same pipeline without recompute (1e-6),
    with as many all-to-alls."""
    parallel = Parallel.build(pp=2, ep=2)
    chunks = chunk_layers(4, 2)
    held = held_layers(chunks, parallel.coords["pp"])
    batches = [(*batch(256, seq=16, seed=10 * rank + i), None) for i in range(4)]
    tokens = torch.tensor(float(sum(labels.numel() for _, labels, _ in batches)))
    results = {}
    for mode in ("none", *MODES):
        model = tiny("qwen3", parallel, mode, layers=4, held=held, micro_batches=4)
        pipeline = Pipeline(model, parallel, torch.float32, chunks, defer_wgrad=True, overlap=True)
        loss, count = counted_all_to_alls(dist, functools.partial(pipeline.step, batches, tokens))
        grads = [local_part(p.grad).clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]
        results[mode] = (loss, grads), count
    for mode in MODES:
        assert_same(results[mode][0], results["none"][0], 1e-6, mode)
        assert results[mode][1] == results["none"][1] > 0, (mode, results[mode][1], results["none"][1])


def test_each_mode_in_the_pipeline_with_pairs_in_turns_gives_the_same_gradients():
    run_on_processes(4, pipeline_body)


def test_compiled_recomputed_stages_give_the_eager_gradients():
    """Qwen3 with its attention stages compiled (fullgraph) and checkpointed, selective: the eager gradients without
    recompute within 1e-5 (the compiler's fused kernels round differently; seen 3.9e-6); the routing is counted once
    per forward, not again in the compiled backward's recompute."""
    ids, labels = batch(256)
    eager = tiny("qwen3")
    expected = gradients(eager, ids, labels)
    model = compile_stages(tiny("qwen3", mode="selective"))
    assert_same(gradients(model, ids, labels), expected, 1e-5, "compiled")
    for ours, theirs in zip(moe_layers(model), moe_layers(eager)):
        assert torch.equal(ours.balance.expert_load, theirs.balance.expert_load)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_apps_runs_under_each_mode_log_the_losses_of_no_recompute(tmp_path, dtype):
    """The app's own loop (4 steps, 2 micro-batches a step; bfloat16: fp32 masters computing in bf16 copies, which
    the recompute swaps back in): the losses of --recompute none, exactly."""
    import pith_apps.train as train_app
    flags = ["qwen3", "--steps", "4", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32", "--quiet",
             "--save-every", "0", "--dtype", dtype]
    losses = {mode: train_app.train(train_app.parse_args([*flags, "--recompute", mode, "--out", str(tmp_path / mode)]))
              for mode in ("none", *MODES)}
    assert losses["selective"] == losses["full"] == losses["none"] and len(losses["none"]) == 4, losses
