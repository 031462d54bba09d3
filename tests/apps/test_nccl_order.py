"""The order of every communication of the real code, recorded on gloo and replayed under NCCL's rules
(tests/comm_order.py): DualPipeV's pipeline at pp 2, 4 and 8 (2pp, 2pp + 1 and 3pp micro-batches, each pair's
forward and backward in turns and one after the other; a forward-only pass for evaluation), alone, with expert
parallelism, with FSDP over data ranks (also as 2 replicas: HSDP) and with context parallelism; and at each of those
layouts the app's whole run of a step (pith_apps.train.train: the step, its gradient norm, optimizer step, expert-bias
update, routing gather and loss all-reduce, evaluation, DCP's save and load, FSDP2's collectives). A case passes when
NCCL would complete every op of every rank: no cycle of waits, every message received as sent, every collective the
same on all members of its group, issued by the same pipeline step, and no two groups of two ranks in opposite orders.
A collective left out of one rank's trace of the app is named. Ring attention's own case is in
test_context_parallel_models.py."""
import pickle
import threading

import pytest
import torch

import pith_apps.train as train_app
from comm_order import Recorder, replay, without
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine import checkpoint
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


RUNNING = {}   # thread name -> the pipeline step (kind, phase, micro-batch) it runs now


def current_step():
    """What the recorder asks at each op: the step the calling thread runs (None between steps)."""
    return RUNNING.get(threading.current_thread().name)


def tagging(pipeline):
    """pipeline, whose forward and backward set their thread's running step (current_step) while they run."""
    def tagged(kind, run):
        def step(step, i):
            name = threading.current_thread().name
            RUNNING[name] = (kind, step.phase, i)
            try:
                return run(step, i)
            finally:
                RUNNING.pop(name)
        return step

    pipeline.forward, pipeline.backward = tagged("F", pipeline.forward), tagged("B", pipeline.backward)
    return pipeline


def check_pipeline(parallel, count, overlap, recompute="none"):
    """One training step and one forward-only pass (evaluation), their traces replayed; the step's p2p batches are
    those `exchanges` plans (whose order test_dualpipev.py replays up to pp 16). recompute: the layers' mode (full:
    the backward runs the ring's exchanges and FSDP's gathers of the recomputed regions again)."""
    model, chunks = pipeline_model(parallel, count)
    recompute_stages(model, recompute)
    batches = micro_batches(parallel, model.config.vocab_size, count)
    pipeline = Pipeline(model, parallel, torch.float32, chunks, defer_wgrad=True, overlap=overlap)
    with Recorder(current_step) as recorder:
        tagging(pipeline).step(batches, torch.tensor(float(SEQ * count * parallel.dp)))
        steps = len(recorder.ops)
        pipeline.loss_sum(*batches[0])
    traces = recorder.gathered()
    planned = [[("send", pipeline.peers[to]) for to, _ in given] + [("recv", pipeline.peers[of]) for of, _ in taken]
               for given, taken in exchanges(parallel.pp, count, parallel.coords["pp"]) if given or taken]
    ran = [[part[:2] for part in op.parts] for op in traces[parallel.rank][:steps]
           if op.kind == "p2p" and op.comm == pipeline.group.group_name]   # not the ring's (cp)
    assert ran == planned and sum(map(len, planned)) >= 4 * count, (ran, planned)   # F and B, in and out
    report = replay(traces) if parallel.rank == 0 else None   # the same traces on every rank: replayed once
    assert report is None, f"{parallel}, {count} micro-batches, overlap {overlap}:\n{report}"


LAYOUTS = {2: [dict(pp=2)],
           4: [dict(pp=4), dict(pp=2, ep=2), dict(pp=2, dp=2), dict(pp=2, dp=2, dp_replicate=2), dict(pp=2, cp=2)],
           8: [dict(pp=8), dict(pp=4, ep=2), dict(pp=4, dp=2), dict(pp=2, cp=2, ep=2)]}


def functions(op) -> set[str]:
    """The functions of Pith's packages on the stack when op was issued."""
    return {line.rsplit(" ", 1)[1] for line in op.stack}


def app_run(parallel: Parallel, out, optimizer: str, flags: list[str], resume_from) -> dict:
    """The app's own train() (pith_apps.train) at this layout into run folder `out`, recorded whole, its pipeline's
    steps tagged: one optimizer step (the fewest layers and micro-batches DualPipeV runs: 2pp of each), its
    evaluation and its checkpoint, after a resume from checkpoint `resume_from` (of a run of the same sizes) when
    given. Checks on rank 0 that NCCL would complete every op of it and that it holds what the step and its edges
    issue; -> every rank's ops."""
    start = int(resume_from.name.removeprefix("step-")) if resume_from else 0
    args = train_app.parse_args(
        ["qwen3", "--layers", str(2 * parallel.pp), "--batch-size", str(2 * parallel.pp * parallel.data_ranks),
         "--micro-batch-size", "1", "--seq-len", str(SEQ), "--steps", str(start + 1), "--eval-every", "1",
         "--eval-batches", "1", "--save-every", "1", "--optimizer", optimizer, "--data-workers", "1", "--quiet",
         "--out", str(out), *flags, *(["--resume-from", str(resume_from)] if resume_from else [])])
    pipeline = train_app.Pipeline
    train_app.Pipeline = lambda *a, **k: tagging(pipeline(*a, **k))
    try:
        with Recorder(current_step) as recorder:
            train_app.train(args)
    finally:
        train_app.Pipeline = pipeline
    traces = recorder.gathered()
    if parallel.rank == 0:
        report = replay(traces)
        assert report is None, f"the app at {parallel}, {optimizer}:\n{report}"
        # what issued the ops: Pith's functions, and each kind with the file of torch that called it (FSDP2, DCP)
        ran = {name for ops in traces.values() for op in ops for name in (
            *functions(op), f"{op.kind} via {op.site.partition(' via ')[2].split(':')[0]}")}
        expected = {"gradient_step", "grad_norm", "train_step", "whole_model_routing", "evaluate", "save",
                    "gather_object via utils.py", "scatter_object_list via utils.py"}
        expected |= {"load"} if resume_from else set()
        expected |= {"update_expert_bias"} if parallel.data_ranks > 1 else set()
        if parallel.dp * parallel.cp * parallel.ep > parallel.dp_replicate:   # FSDP2 shards over more than this rank
            expected |= {"all_gather_single via _fsdp_collectives.py", "reduce_scatter_single via _fsdp_collectives.py"}
            expected |= {"split_orthogonalize"} if optimizer == "muon" else set()
        expected |= {"all_reduce via _fsdp_collectives.py"} if parallel.dp_replicate > 1 else set()   # HSDP's
        assert expected <= ran, (parallel, optimizer, expected - ran)
    return traces


def pipeline_order_body(rank, world, root):
    """Each layout's pipeline cases (check_pipeline), then the app's run there (app_run): on 2 processes with AdamW;
    on more with Muon, a layout resuming from the previous one's checkpoint where both have the same pp and data
    ranks (pp 2 x dp 2 from pp 2 x ep 2 and its HSDP from it, pp 4 x dp 2 from pp 4 x ep 2). The app's traces at
    pp 2 x dp 2 go to root for the tests below."""
    # with torch's default of a thread per core in every process, the 8-process case took minutes on 2 cores
    torch.set_num_threads(1)
    for sizes in LAYOUTS[world]:
        parallel = Parallel.build(**sizes)
        for count in (2 * parallel.pp, 2 * parallel.pp + 1, 3 * parallel.pp):
            for overlap in (False, True) if parallel.ep > 1 else (False,):
                check_pipeline(parallel, count, overlap)
        if parallel.cp > 1:
            check_pipeline(parallel, 2 * parallel.pp, True, "full")
    made = []   # each run's (pp, data ranks), which decide its layers and batch size
    for number, sizes in enumerate(LAYOUTS[world]):
        parallel = Parallel.build(**sizes)
        made.append((parallel.pp, parallel.data_ranks))
        flags = [f"--{name.replace('_', '-')}={size}" for name, size in sizes.items()]
        previous = checkpoint.latest(root / f"run{number - 1}" / "checkpoints") if made[-2:-1] == made[-1:] else None
        traces = app_run(parallel, root / f"run{number}", "adamw" if world == 2 else "muon", flags, previous)
        if sizes == dict(pp=2, dp=2) and rank == 0:
            (root / "traces.pkl").write_bytes(pickle.dumps(traces))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """world -> the app's traces at pp 2 x dp 2 (None at other worlds), each world's processes run once."""
    runs = {}

    def of(world: int):
        if world not in runs:
            root = tmp_path_factory.mktemp(f"nccl_order_{world}")
            run_on_processes(world, pipeline_order_body, root)
            saved = root / "traces.pkl"
            runs[world] = pickle.loads(saved.read_bytes()) if saved.exists() else None
        return runs[world]
    return of


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_the_pipelines_exchanges_complete_under_nccls_rules(world, spawned):
    """On `world` processes, each layout of LAYOUTS at 2pp, 2pp + 1 and 3pp micro-batches; with expert
    parallelism, the pairs in turns and not; with context parallelism also under full recompute. Then the app's
    whole run at each layout (app_run): its step (the pipeline, the gradient norm, AdamW or Muon, the expert-bias
    update, the routing gather, the loss and stop all-reduce), evaluation, DCP's save and load and FSDP2's
    collectives."""
    spawned(world)


@pytest.mark.parametrize("skipped, site", [("grad_norm", "data_parallel.py:"),
                                           ("split_orthogonalize", " < muon.py:"), ("save", "checkpoint.py:")])
def test_a_collective_that_one_rank_skips_in_the_apps_step_is_named(spawned, skipped, site):
    """The app's run at pp 2 x dp 2 (Muon, resumed; recorded on 4 processes) with rank 1's first collective of
    `skipped` left out of its trace (the gradient norm's all-reduce, the first all-to-all of Muon's deal, DCP's first
    gather_object of a save): the report says that rank 1 never issues it, naming rank 0's and its line."""
    traces = spawned(4)

    def first(rank):
        return next(op for op in traces[rank] if op.kind != "p2p" and skipped in functions(op)
                    and (skipped != "save" or op.kind == "gather_object"))
    dropped, kept = first(1), first(0)
    report = replay(without(traces, 1, dropped.index))
    assert report.startswith("rank 1 never issues collective #") and f"\n  {kept}\n" in report, report
    assert (kept.kind, kept.comm) == (dropped.kind, dropped.comm) and site in kept.site, kept


def failing_pair_body(rank, world):
    """pp 1 x ep 2, pairs in turns: the first pair's backward raises on both ranks before its first all-to-all. Its
    forward, which had launched one (the counts of its dispatch), stops at its next pass instead of running its
    chunk alone: the step raises the backward's error, and the forward issued nothing after that all-to-all."""
    parallel = Parallel.build(ep=2)
    model, chunks = pipeline_model(parallel, 3)
    pipeline = tagging(Pipeline(model, parallel, torch.float32, chunks, overlap=True))
    backward = pipeline.backward

    def failing(step, i):
        raise ValueError("planted")
    pipeline.backward = lambda step, i: (failing if i == 0 and step.phase == 1 else backward)(step, i)
    with Recorder(current_step) as recorder:
        with pytest.raises(ValueError, match="^planted$"):
            pipeline.step(micro_batches(parallel, model.config.vocab_size, 3), torch.tensor(48.0))
    kinds = [op.kind for op in recorder.gathered()[rank] if op.tag == ("F", 0, 1)]
    assert kinds.count("all_to_all_single") == 1 and kinds[-1] == "all_to_all_single", kinds


def test_when_a_pairs_side_raises_its_other_side_issues_nothing_more():
    run_on_processes(2, failing_pair_body)
