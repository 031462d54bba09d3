"""DualPipeV's pipeline (pith_engine.dualpipev.Pipeline) against the single-process run of the same micro-batches:
every pipeline rank builds only its two chunks' layers (held_layers) from the seed the whole reference model
is drawn from; the step's loss (at rank 0) and every gradient a rank holds match the sequential run's, aux
losses on."""
import collections
import itertools
import threading

import pytest
import torch
import torch.distributed as dist

from conftest import relative_error
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.models.layers import Linear
from pith_apps.options import MODELS, PRESETS
from pith_engine.data_parallel import ComputeCasts, _fsdp_param_groups, local_part, shard_model
from pith_engine.dualpipev import Pipeline, chunk_layers, held_layers, numbered, schedule
from pith_engine.parallel import LayoutError, Parallel

SEQ = 16


def tiny(family, parallel, micro_batches, held=None):
    """The tiny preset with 2 layers per pipeline chunk (DeepSeek-V2's first dense); held: its layers built."""
    config_cls, model_cls = MODELS[family]
    layers = 4 * parallel.pp
    data = read_json(PRESETS / f"{family}_tiny.json") | {"num_hidden_layers": layers, "initializer_range": 0.2}
    if family == "gpt_oss":
        data["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    model = model_cls(config_cls.from_dict(data), parallel, micro_batches=micro_batches, held_layers=held)
    model.init_weights(seed=4)
    return model


def micro_batches(vocab, count, data_rank):
    generator = torch.Generator().manual_seed(6 + data_rank)   # expert-parallel ranks read different data
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (2, SEQ + 1), generator=generator)
        labels = ids[:, 1:].clone()
        labels[0, :3] = -100   # ignored positions: the step's token count is not batch x seq
        batches.append((ids[:, :-1], labels, None))
    return batches


def held_names(names, pp, rank):
    """Of the whole model's parameter names, those of rank's chunks r and 2pp-1-r, embedding and head on rank 0."""
    chunks = chunk_layers(4 * pp, pp)
    layers = {n for chunk in (rank, 2 * pp - 1 - rank) for n in chunks[chunk]}
    return {name for name in names if (name.startswith("model.layers.") and int(name.split(".")[2]) in layers)
            or (rank == 0 and not name.startswith("model.layers."))}


def sequential_run(model, batches, tokens):
    expected = torch.zeros(())
    for ids, labels, docs in batches:
        loss = model.loss_sum(ids, labels, docs) / tokens
        loss.backward()
        expected += loss.detach()
    return expected, {name: param.grad for name, param in model.named_parameters()}


VARIANTS = [dict(), dict(defer_wgrad=True), dict(overlap=True)]


def check_against_sequential(family, parallel, count, mixed=False, variants=VARIANTS):
    """mixed: fp32 master weights computing in bf16 copies (one-process mixed precision, ComputeCasts). Plain,
    with the expert weight gradients deferred to W steps, and with each pair's forward and backward in turns:
    the same gradients (deferred 1e-6: only the order of the additions into .grad differs; in turns exactly,
    the same kernels on the same numbers), nothing left deferred after the step, and in turns each pair's
    all-to-alls alternate between its forward and its backward (`expected_turns`)."""
    rank, chunks = parallel.coords["pp"], chunk_layers(4 * parallel.pp, parallel.pp)
    reference = tiny(family, parallel, count)
    models = [tiny(family, parallel, count, held_layers(chunks, rank)) for _ in variants]
    for built in (reference, *models) if mixed else ():
        ComputeCasts(torch.bfloat16).register(built)
    batches = micro_batches(reference.config.vocab_size, count, parallel.data_rank)
    tokens = sum((labels != -100).sum() for _, labels, _ in batches)
    expected, grads = sequential_run(reference, batches, tokens)
    dtype = torch.bfloat16 if mixed else torch.float32
    traces = []
    for variant, model in zip(variants, models):
        pipeline = Pipeline(model, parallel, dtype, chunks, **variant)
        ran = []   # closures each W step runs: per layer of the deferring backward's chunk, its dense linears' and
        if pipeline.deferred is not None:   # its experts' 2 grouped GEMMs
            run_oldest = pipeline.deferred.run_oldest
            pipeline.deferred.run_oldest = lambda: ran.append(len(pipeline.deferred.entries[0])) or run_oldest()
        loss, trace = traced_step(pipeline, batches, tokens)
        traces.append(trace)
        steps = [step for steps in schedule(parallel.pp, count, rank) for step in steps]
        defer = pipeline.deferred is not None
        deferring = [step.phase for step in steps if step.kind == "B" and step.defer]
        assert len(ran) == defer * len(deferring) and sum(ran) == defer * sum(
            deferred_closures(model, pipeline.layers[phase]) for phase in deferring), ran
        assert not defer or not pipeline.deferred.entries and pipeline.deferred.open is None
        held = dict(model.named_parameters())
        assert set(held) == held_names(grads, parallel.pp, rank), (family, rank)
        for name, param in held.items():
            assert relative_error(param.grad, grads[name]) < 1e-5, (family, rank, variant, name)
        if rank == 0:
            assert abs(loss - expected) < 1e-6 * expected, family
    plain, deferred, *turns = ([param.grad for param in model.parameters()] for model in models)
    assert all(relative_error(other, grad) < 1e-6 for grad, other in zip(plain, deferred)), (family, rank)
    for grads_in_turns, trace in zip(turns, traces[2:]):
        assert all(torch.equal(other, grad) for grad, other in zip(plain, grads_in_turns)), (family, rank)
        assert trace == expected_turns(traces[0], schedule(parallel.pp, count, rank)), (family, rank)
        assert parallel.ep == 1 or any(kind == "B" for kind, _, _ in trace), trace


def deferred_closures(model, layers):
    """What a deferring backward of these layers queues: a closure per dense linear (all but the router) and two
    per expert stack (its gate_up and down grouped GEMMs)."""
    return sum(isinstance(module, Linear) + 2 * (model.layers[n].is_moe and module is model.layers[n].experts)
               for n in layers for module in model.layers[n].modules())


def traced_step(pipeline, batches, tokens):
    """(the step's loss, its all-to-alls in call order: each as the (kind, phase, micro-batch) of the step that
    called it, told apart by thread where a pair's forward and backward take turns)."""
    trace, current = [], {}

    def marked(kind, run):
        def step(step, i):
            current[threading.current_thread().name] = (kind, step.phase, i)
            return run(step, i)
        return step

    def recorded(*args, **kwargs):
        trace.append(current[threading.current_thread().name])
        return all_to_all(*args, **kwargs)

    pipeline.forward, pipeline.backward = marked("F", pipeline.forward), marked("B", pipeline.backward)
    all_to_all, dist.all_to_all_single = dist.all_to_all_single, recorded
    try:
        return pipeline.step(batches, tokens), trace
    finally:
        dist.all_to_all_single = all_to_all


def expected_turns(plain_trace, plan):
    """The all-to-alls in turns, from those of the plain run (each step's, in order): a pair's forward and
    backward alternate, the forward's first, until one has none left."""
    of_step = {}
    for key in plain_trace:
        of_step.setdefault(key, []).append(key)
    expected = []
    for steps, numbers in numbered(plan):
        calls = [of_step.get((step.kind, step.phase, i), []) for step, i in zip(steps, numbers) if i is not None]
        if len(calls) == 2:
            expected += [key for pair in itertools.zip_longest(*calls) for key in pair if key is not None]
        else:
            expected += [key for keys in calls for key in keys]
    return expected


def pipeline_body(rank, world, families, count, ep=1, mixed=False, variants=VARIANTS):
    parallel = Parallel.build(pp=world // ep, ep=ep)
    for family in families:
        check_against_sequential(family, parallel, count, mixed, variants)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("family", list(MODELS))
def test_one_rank_runs_both_chunks_as_the_sequential_run(family, mixed):
    check_against_sequential(family, Parallel(), 3, mixed)


@pytest.mark.parametrize("mixed", [False, True])
def test_two_pipeline_ranks_give_the_sequential_runs_loss_and_gradients(mixed):
    """pp = 2 over gloo, 5 micro-batches (more than the 2pp minimum: the main overlapped phase runs), each family;
    in fp32 and in mixed precision (the same bf16 computations as the sequential run's)."""
    run_on_processes(2, pipeline_body, list(MODELS), 5, 1, mixed)


def test_two_pipeline_ranks_of_two_expert_parallel_ranks_give_the_sequential_runs_loss_and_gradients():
    """pp = 2 x ep = 2: each pipeline rank's experts spread over its expert-parallel pair, which runs the same
    schedule on its own data; the reference is that pair's sequential run (expert parallelism itself is checked
    against one process in test_parallel_training.py). The tokens are each rank's own."""
    run_on_processes(4, pipeline_body, ["qwen3", "deepseek_v2"], 4, 2)


def test_four_pipeline_ranks_give_the_sequential_runs_loss_and_gradients():
    """pp = 4 over gloo, the minimum 8 micro-batches (plain and deferred; turns need the all-to-alls of ep > 1)."""
    run_on_processes(4, pipeline_body, ["qwen3", "deepseek_v2"], 8, 1, False, VARIANTS[:2])


def fsdp_body(rank, world, families, mixed):
    """pp 2 x dp 2, each stage's weights sharded by FSDP, deferral off and on: the sharded gradients agree, and with
    deferral every FSDP module reduce-scatters once, after the step's last W step (not after each backward)."""
    parallel = Parallel.build(pp=2, dp=2)
    chunks, dtype = chunk_layers(8, 2), torch.bfloat16 if mixed else torch.float32
    reduce_scatter = dist.reduce_scatter_single
    for family in families:
        grads, reductions = [], []
        for defer in (False, True):
            model = tiny(family, parallel, 4, held_layers(chunks, parallel.coords["pp"]))
            shard_model(model, parallel, torch.bfloat16 if mixed else None)
            batches = micro_batches(model.config.vocab_size, 4, parallel.data_rank)
            tokens = sum((labels != -100).sum() for _, labels, _ in batches)
            calls = []
            dist.reduce_scatter_single = lambda *args, **kwargs: calls.append(1) or reduce_scatter(*args, **kwargs)
            try:
                Pipeline(model, parallel, dtype, chunks, defer_wgrad=defer).step(batches, tokens)
            finally:
                dist.reduce_scatter_single = reduce_scatter
            grads.append([local_part(param.grad) for param in model.parameters()])
            reductions.append(len(calls))
        fsdp_modules = sum(1 for module in model.modules() if type(module).__name__.startswith("FSDP"))
        assert reductions[1] == fsdp_modules < reductions[0], (family, reductions, fsdp_modules)
        for plain, deferred in zip(*grads):
            assert relative_error(deferred, plain) < (1e-5 if mixed else 1e-6), (family, mixed)


@pytest.mark.parametrize("mixed", [False, True])
def test_deferred_weight_gradients_under_fsdp_are_reduced_once_after_the_last_w_step(mixed):
    """fp32 with each family (GPT-OSS: dense linears with biases), and mixed precision (bf16 compute, fp32
    reduction) for Qwen3, whose W steps' bf16 gradients are folded into FSDP's fp32 sums."""
    run_on_processes(4, fsdp_body, list(MODELS) if not mixed else ["qwen3"], mixed)


def resharding_body(rank, world):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    parallel = Parallel.build(pp=2, dp=2)
    chunks = chunk_layers(8, 2)
    model = tiny("qwen3", parallel, 4, held_layers(chunks, parallel.coords["pp"]))
    shard_model(model, parallel, torch.bfloat16)
    pipeline = Pipeline(model, parallel, torch.bfloat16, chunks, defer_wgrad=True)
    in_layers = {id(module) for layer in model.layers.values() for module in (layer, layer.experts)}
    gathered, ahead, forward = [], collections.Counter(), pipeline.forward

    def measured(step, i):   # the bytes of every gathered weight FSDP holds, after each chunk's forward
        out = forward(step, i)
        gathered.append(sum(t.untyped_storage().nbytes() for group in _fsdp_param_groups(model)
                            for param in group.fsdp_params for t in param.all_gather_outputs))
        return out
    for hook in ("pre_forward", "pre_backward"):   # whether a layer's gather is under way when its own call comes
        def seen(group, *args, run=getattr(FSDPParamGroup, hook), hook=hook):
            if id(group.modules[0]) in in_layers:
                ahead[hook, group._all_gather_result is not None] += 1
            return run(group, *args)
        setattr(FSDPParamGroup, hook, seen)   # (the spawned process ends with the test)
    pipeline.forward = measured
    batches = micro_batches(model.config.vocab_size, 4, parallel.data_rank)
    pipeline.step(batches, sum((labels != -100).sum() for _, labels, _ in batches))
    assert gathered == [0] * 8, gathered   # 2 chunks x 4 micro-batches
    # per chunk and micro-batch 4 FSDP modules (2 layers, each with its experts): 3 prefetched, the first gathered
    assert ahead == {("pre_forward", True): 24, ("pre_forward", False): 8, ("pre_backward", True): 24,
                     ("pre_backward", False): 8}, ahead


def test_under_fsdp_each_layer_lets_its_gathered_weights_go_after_its_forward_and_prefetches_the_next():
    """pp 2 x dp 2, Qwen3 in mixed precision, 2 layers a chunk, deferring as the app does: after every chunk's forward
    FSDP holds 0 bytes of gathered weights (each layer, a root of its own, kept its bf16 weights whole until its
    backward before: 268,032 bytes on pipeline rank 0 after its first forward, up to 536,320 later), and within a
    chunk each FSDP module but the first (in the backward, the last) finds its gather issued by the one before it."""
    run_on_processes(4, resharding_body)


def test_the_layers_split_into_chunks_evenly_or_as_asked_and_a_bad_split_is_one_line():
    assert [len(r) for r in chunk_layers(10, 2)] == [2, 3, 3, 2]   # spare layers nearest the turn of the V
    assert [list(r) for r in chunk_layers(5, 2, [2, 1, 1, 1])] == [[0, 1], [2], [3], [4]]
    with pytest.raises(LayoutError, match=r"^layers per chunk \[2, 2, 0, 1\] must be 4 positive counts \(2 x pp\) "
                                          r"summing to the model's 5 layers$"):
        chunk_layers(5, 2, [2, 2, 0, 1])
    with pytest.raises(LayoutError, match=r"^3 layers cannot fill the 2 x pp = 4 chunks of DualPipeV \(at least one "
                                          r"layer each\); lower pp to at most 1$"):
        chunk_layers(3, 2)
