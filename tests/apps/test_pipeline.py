"""DualPipeV's pipeline (pith_engine.dualpipev.Pipeline) against the single-process run of the same micro-batches:
every pipeline rank builds only its two chunks' layers (held_layers) from the seed the whole reference model
is drawn from; the step's loss (at rank 0) and every gradient a rank holds match the sequential run's, aux
losses on."""
import pytest
import torch

from conftest import relative_error
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine.data_parallel import ComputeCasts
from pith_engine.dualpipev import Pipeline, chunk_layers, held_layers, schedule
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


def check_against_sequential(family, parallel, count, mixed=False):
    """mixed: fp32 master weights computing in bf16 copies (one-process mixed precision, ComputeCasts). Without
    and with the expert weight gradients deferred to W steps: the same gradients (1e-6: only the order of the
    additions into .grad differs), nothing left deferred after the step."""
    rank, chunks = parallel.coords["pp"], chunk_layers(4 * parallel.pp, parallel.pp)
    reference = tiny(family, parallel, count)
    models = [tiny(family, parallel, count, held_layers(chunks, rank)) for defer in (False, True)]
    for built in (reference, *models) if mixed else ():
        ComputeCasts(torch.bfloat16).register(built)
    batches = micro_batches(reference.config.vocab_size, count, parallel.data_rank)
    tokens = sum((labels != -100).sum() for _, labels, _ in batches)
    expected, grads = sequential_run(reference, batches, tokens)
    dtype = torch.bfloat16 if mixed else torch.float32
    for defer, model in zip((False, True), models):
        pipeline = Pipeline(model, parallel, dtype, chunks, defer_wgrad=defer)
        ran = []   # closures each W step runs: the deferring backward's 2 expert GEMMs per MoE layer of its chunk
        if defer:
            run_oldest = pipeline.deferred.run_oldest
            pipeline.deferred.run_oldest = lambda: ran.append(len(pipeline.deferred.entries[0])) or run_oldest()
        loss = pipeline.step(batches, tokens)
        steps = [step for steps in schedule(parallel.pp, count, rank) for step in steps]
        assert len(ran) == defer * sum(step.kind == "W" for step in steps) and all(n >= 2 for n in ran), ran
        held = dict(model.named_parameters())
        assert set(held) == held_names(grads, parallel.pp, rank), (family, rank)
        for name, param in held.items():
            assert relative_error(param.grad, grads[name]) < 1e-5, (family, rank, defer, name)
        if rank == 0:
            assert abs(loss - expected) < 1e-6 * expected, family
    deferred = models[1].named_parameters()
    for (name, param), (_, other) in zip(models[0].named_parameters(), deferred):
        assert relative_error(other.grad, param.grad) < 1e-6, (family, rank, name)
    assert not pipeline.deferred.entries and pipeline.deferred.open is None


def pipeline_body(rank, world, families, count, ep=1, mixed=False):
    parallel = Parallel.build(pp=world // ep, ep=ep)
    for family in families:
        check_against_sequential(family, parallel, count, mixed)


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
    """pp = 4 over gloo, the minimum 8 micro-batches."""
    run_on_processes(4, pipeline_body, ["qwen3", "deepseek_v2"], 8)


def test_the_layers_split_into_chunks_evenly_or_as_asked_and_a_bad_split_is_one_line():
    assert [len(r) for r in chunk_layers(10, 2)] == [2, 3, 3, 2]   # spare layers nearest the turn of the V
    assert [list(r) for r in chunk_layers(5, 2, [2, 1, 1, 1])] == [[0, 1], [2], [3], [4]]
    with pytest.raises(LayoutError, match=r"^layers per chunk \[2, 2, 0, 1\] must be 4 positive counts \(2 x pp\) "
                                          r"summing to the model's 5 layers$"):
        chunk_layers(5, 2, [2, 2, 0, 1])
    with pytest.raises(LayoutError, match=r"^3 layers cannot fill the 2 x pp = 4 chunks of DualPipeV \(at least one "
                                          r"layer each\); lower pp to at most 1$"):
        chunk_layers(3, 2)
