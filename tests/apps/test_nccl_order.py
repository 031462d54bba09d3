"""The order of every communication of the real code, recorded on gloo and replayed under NCCL's rules
(tests/comm_order.py): DualPipeV's pipeline at pp 2, 4 and 8 (2pp, 2pp + 1 and 3pp micro-batches, a pair's
forward and backward in turns or one after the other), with expert parallelism, with FSDP over data ranks and with
context parallelism; ring attention forward and backward. Each case passes when NCCL would complete every op of
every rank: no cycle of waits, every collective the same on all members (the pipeline's: the same step's)."""
import threading

import pytest
import torch

from comm_order import Recorder, replay
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine.context_parallel import zigzag_part
from pith_engine.data_parallel import shard_model
from pith_engine.dualpipev import Pipeline, chunk_layers, held_layers
from pith_engine.parallel import Parallel

SEQ = 16


def pipeline_model(parallel, count, family="qwen3"):
    """The tiny preset with one layer per pipeline chunk, only this rank's two built; FSDP where data ranks share it."""
    config_cls, model_cls = MODELS[family]
    chunks = chunk_layers(2 * parallel.pp, parallel.pp)
    data = read_json(PRESETS / f"{family}_tiny.json") | {"num_hidden_layers": 2 * parallel.pp}
    model = model_cls(config_cls.from_dict(data), parallel, micro_batches=count,
                      held_layers=held_layers(chunks, parallel.coords["pp"]))
    model.init_weights(seed=3)
    if parallel.sharded and parallel.dp * parallel.cp > 1:
        shard_model(model, parallel, None)
    return model, chunks


def micro_batches(parallel, vocab, count):
    generator = torch.Generator().manual_seed(parallel.data_rank)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (1, SEQ + 1), generator=generator)
        ids, labels = ids[:, :-1], ids[:, 1:]
        if parallel.cp > 1:
            ids, labels = (zigzag_part(t, parallel.cp, parallel.coords["cp"]) for t in (ids, labels))
        batches.append((ids, labels, None))
    return batches


def recorded_step(pipeline, batches, tokens):
    """The traces of every rank of one pipeline step, each op tagged with the step (kind, phase, micro-batch) of
    the thread that issued it."""
    running = {}

    def tagged(kind, run):
        def step(step, i):
            running[threading.current_thread().name] = (kind, step.phase, i)
            return run(step, i)
        return step

    pipeline.forward, pipeline.backward = tagged("F", pipeline.forward), tagged("B", pipeline.backward)
    with Recorder(lambda: running.get(threading.current_thread().name)) as recorder:
        pipeline.step(batches, tokens)
    return recorder.gathered()


def pipeline_order_body(rank, world, sizes, counts, overlaps):
    parallel = Parallel.build(**sizes)
    for count in counts(parallel.pp):
        for overlap in overlaps:
            model, chunks = pipeline_model(parallel, count)
            batches = micro_batches(parallel, model.config.vocab_size, count)
            pipeline = Pipeline(model, parallel, torch.float32, chunks, defer_wgrad=True, overlap=overlap)
            traces = recorded_step(pipeline, batches, torch.tensor(float(SEQ * count * parallel.dp)))
            report = replay(traces)
            # today's pipeline: each send a batch of its own, receives posted when needed; rank 0 sends F0#1
            # while rank 1 sends F1#0, each waiting for a receive queued behind the other's send
            assert report.startswith("NCCL would hang, in this cycle of waits:"), report
            assert "send to 1 (2048 x torch.float32) [('F', 0, 1)]" in report, report


def every_count(pp):
    return [2 * pp, 2 * pp + 1, 3 * pp]


@pytest.mark.parametrize("pp", [2])
def test_the_pipelines_exchanges_hang_under_nccls_rules(pp):
    run_on_processes(pp, pipeline_order_body, dict(pp=pp), every_count, [False])
