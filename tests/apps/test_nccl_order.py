"""The order of every communication of the real code, recorded on gloo and replayed under NCCL's rules
(tests/comm_order.py): DualPipeV's pipeline at pp 2, 4 and 8 (2pp, 2pp + 1 and 3pp micro-batches, each pair's
forward and backward in turns and one after the other; a forward-only pass for evaluation), alone, with expert
parallelism, with FSDP over data ranks (also as 2 replicas: HSDP) and with context parallelism. A case passes when NCCL would complete every
op of every rank: no cycle of waits, and every collective the same on all members of its group, issued by the same
pipeline step. Ring attention's own case is in test_context_parallel_models.py."""
import threading

import pytest
import torch

from comm_order import Recorder, replay
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine.context_parallel import zigzag_part
from pith_engine.data_parallel import shard_model
from pith_engine.dualpipev import Pipeline, chunk_layers, exchanges, held_layers
from pith_engine.parallel import Parallel
from pith_engine.recompute import recompute_stages

SEQ = 16


def pipeline_model(parallel, count, family="qwen3"):
    """The tiny preset with one layer per pipeline chunk, only this rank's two built; FSDP where ranks share it."""
    config_cls, model_cls = MODELS[family]
    chunks = chunk_layers(2 * parallel.pp, parallel.pp)
    data = read_json(PRESETS / f"{family}_tiny.json") | {"num_hidden_layers": 2 * parallel.pp}
    model = model_cls(config_cls.from_dict(data), parallel, micro_batches=count,
                      held_layers=held_layers(chunks, parallel.coords["pp"]))
    model.init_weights(seed=3)
    if parallel.sharded:
        shard_model(model, parallel, None)
    return model, chunks


def micro_batches(parallel, vocab, count):
    """This data rank's micro-batches of one sequence, each cp rank's zigzag part of it."""
    generator = torch.Generator().manual_seed(parallel.data_rank)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (1, SEQ + 1), generator=generator)
        ids, labels = ids[:, :-1], ids[:, 1:]
        if parallel.cp > 1:
            ids, labels = (zigzag_part(t, parallel.cp, parallel.coords["cp"]) for t in (ids, labels))
        batches.append((ids, labels, None))
    return batches


def tagging(pipeline):
    """pipeline's forward and backward set the running step (kind, phase, micro-batch) of their thread; returns
    tag(), which the recorder asks at each op."""
    running = {}

    def tagged(kind, run):
        def step(step, i):
            running[threading.current_thread().name] = (kind, step.phase, i)
            return run(step, i)
        return step

    pipeline.forward, pipeline.backward = tagged("F", pipeline.forward), tagged("B", pipeline.backward)
    return lambda: running.get(threading.current_thread().name)


def check_pipeline(parallel, count, overlap, recompute="none"):
    """One training step and one forward-only pass (evaluation), their traces replayed; the step's p2p batches are
    those `exchanges` plans (whose order test_dualpipev.py replays up to pp 16). recompute: the layers' mode (full:
    the backward runs the ring's exchanges and FSDP's gathers of the recomputed regions again)."""
    model, chunks = pipeline_model(parallel, count)
    recompute_stages(model, recompute)
    batches = micro_batches(parallel, model.config.vocab_size, count)
    pipeline = Pipeline(model, parallel, torch.float32, chunks, defer_wgrad=True, overlap=overlap)
    with Recorder(tagging(pipeline)) as recorder:
        pipeline.step(batches, torch.tensor(float(SEQ * count * parallel.dp)))
        steps = len(recorder.ops)
        pipeline.loss_sum(*batches[0])
    traces = recorder.gathered()
    planned = [[("send", pipeline.peers[to]) for to, _ in given] + [("recv", pipeline.peers[of]) for of, _ in taken]
               for given, taken in exchanges(parallel.pp, count, parallel.coords["pp"]) if given or taken]
    ran = [[part[:2] for part in op.parts] for op in traces[parallel.rank][:steps]
           if op.kind == "p2p" and op.comm == pipeline.group.group_name]   # not the ring's (cp)
    assert ran == planned and sum(map(len, planned)) >= 4 * count, (ran, planned)   # F and B, in and out
    report = replay(traces)
    assert report is None, f"{parallel}, {count} micro-batches, overlap {overlap}:\n{report}"


LAYOUTS = {2: [dict(pp=2)],
           4: [dict(pp=4), dict(pp=2, ep=2), dict(pp=2, dp=2), dict(pp=2, dp=2, dp_replicate=2)],
           8: [dict(pp=8), dict(pp=4, ep=2), dict(pp=4, dp=2), dict(pp=2, cp=2, ep=2)]}


def pipeline_order_body(rank, world):
    # with torch's default of a thread per core in every process, the 8-process case took minutes on 2 cores
    torch.set_num_threads(1)
    for sizes in LAYOUTS[world]:
        parallel = Parallel.build(**sizes)
        for count in (2 * parallel.pp, 2 * parallel.pp + 1, 3 * parallel.pp):
            for overlap in (False, True) if parallel.ep > 1 else (False,):
                check_pipeline(parallel, count, overlap)
        if parallel.cp > 1:
            check_pipeline(parallel, 2 * parallel.pp, True, "full")


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_the_pipelines_exchanges_complete_under_nccls_rules(world):
    """On `world` processes, each layout of LAYOUTS at 2pp, 2pp + 1 and 3pp micro-batches; with expert
    parallelism, the pairs in turns and not; with context parallelism also under full recompute."""
    run_on_processes(world, pipeline_order_body)


def failing_pair_body(rank, world):
    """pp 1 x ep 2, pairs in turns: the first pair's backward raises on both ranks before its first all-to-all. Its
    forward, which had launched one (the counts of its dispatch), stops at its next pass instead of running its
    chunk alone: the step raises the backward's error, and the forward issued nothing after that all-to-all."""
    parallel = Parallel.build(ep=2)
    model, chunks = pipeline_model(parallel, 3)
    pipeline = Pipeline(model, parallel, torch.float32, chunks, overlap=True)
    tag = tagging(pipeline)
    backward = pipeline.backward

    def failing(step, i):
        raise ValueError("planted")
    pipeline.backward = lambda step, i: (failing if i == 0 and step.phase == 1 else backward)(step, i)
    with Recorder(tag) as recorder:
        with pytest.raises(ValueError, match="^planted$"):
            pipeline.step(micro_batches(parallel, model.config.vocab_size, 3), torch.tensor(48.0))
    kinds = [op.kind for op in recorder.gathered()[rank] if op.tag == ("F", 0, 1)]
    assert kinds.count("all_to_all_single") == 1 and kinds[-1] == "all_to_all_single", kinds


def test_when_a_pairs_side_raises_its_other_side_issues_nothing_more():
    run_on_processes(2, failing_pair_body)
