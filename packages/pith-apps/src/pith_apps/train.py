"""The Pith training app: `hatch run apps:train qwen3` (or `python -m pith_apps.train qwen3`), and on several
processes `torchrun --nproc-per-node N -m pith_apps.train qwen3 --ep 2 ...` with the same flags.

Reads a model config (a preset or a config.json), builds the model for this rank's share of the layout,
streams batches from a text dataset (every rank reads the whole global batch and takes its rows), and trains
with AdamW or Muon, showing a progress bar, writing TensorBoard scalars to <out>/tb and atomic distributed
checkpoints to <out>/checkpoints that --resume continues from, under the same or another layout.
"""
import dataclasses
import functools
import gc
import json
import math
import os
import re
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from pith_apps.config import ConfigError, NonFinite, flops_per_token, read_json, require
from pith_apps.data import (ByteTokenizer, HFTokenizer, batch_at, document_ids, held_out_batch, split_held_out,
                            token_store)
from pith_apps.models.layers import hidden_matrices, use_fp8
from pith_apps.options import (DTYPES, MODELS, check_args, check_export, hf_config_data, init_checkpoint,
                               model_config, parse_args, run_config_text)
from pith_apps.run_log import RunLog, busy_cpu_advice, make_progress, peak_tflops
from pith_apps.stop_signals import StopSignals
from pith_engine.compile import compile_stages
from pith_engine.context_parallel import zigzag_part
from pith_engine.contract import check_model, moe_layers
from pith_engine.cuda_graph import CaptureError, StepGraph
from pith_engine.dualpipev import Pipeline, chunk_layers, held_layers, schedule
from pith_engine.data_parallel import (drop_compute_copies, grad_norm, keep_compute_copies,
                                       pair_expert_wgrads, release_forward_weights, shard_model)
from pith_engine.moe import LoadBalance, update_expert_bias
from pith_engine.muon import muon
from pith_engine.optim import adamw, clipped_step, lr_at
from pith_engine.parallel import LayoutError, Parallel, timed_out_line
from pith_engine.recompute import recompute_stages
from pith_ops.fp8 import Fp8WeightCache


def train(args) -> list[float]:
    """Run the training loop; returns the loss of every step run (the same on every rank)."""
    check_args(args)
    cfg = model_config(args)
    out = Path(args.out or f"runs/{args.model}-{Path(args.init).name if args.init else args.preset}")
    if args.export_hf:
        check_export(args, out)
    lead = int(os.environ.get("RANK", "0")) == 0   # the process group is not joined yet
    log = print if lead and not args.quiet else lambda line: None
    if args.warmup >= args.steps:
        log(f"--warmup {args.warmup} is not shorter than --steps {args.steps}: the learning rate rises for the whole "
            f"run and never reaches --lr {args.lr}")
    busy = args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ and busy_cpu_advice(   # torchrun sets it
        os.getloadavg()[0], len(os.sched_getaffinity(0)), torch.get_num_threads())
    if busy:
        log(busy)
    stream = training_tokens(args, cfg, log=log)
    stream, held_out = split_held_out(stream, args.eval_batches if args.eval_every else 0, args.batch_size, args.seq_len)
    joined = join_processes(args, out)
    from pith_apps.run_folder import RunFolder   # heavy import (DCP, DTensor: ~0.8 s): only when training
    folder = RunFolder(out)
    try:
        parallel, device = layout(args)
        run_id, resume_from = on_lead(parallel, lambda: folder.open(
            args.model, config_dict(cfg), args.resume, args.resume_from, args.overwrite))
        if device.type == "cuda":   # where NCCL's watchdog writes a timed-out rank's collectives (join_processes)
            (out / "comm-trace").mkdir(exist_ok=True)
        return train_on(args, cfg, parallel, device, (stream, held_out), folder, run_id, resume_from)
    except NonFinite as err:
        raise ConfigError(f"{err}; {on_lead(parallel, lambda: folder.way_back(run_id, args.lr, err.before))}") from None
    except RuntimeError as err:   # gloo's "Timed out waiting", NCCL's watchdog "timeout"
        if joined and re.search(r"[Tt]imed out|timeout", str(err)):
            raise TimedOut(timed_out_line(err, args.dist_timeout, out / "comm-trace")) from None
        raise
    finally:
        folder.release()
        if joined:
            dist.destroy_process_group()
            # collect the destroyed groups' cycles now: collected at interpreter exit instead, gloo's sub-groups
            # (the device mesh's) aborted the process in 16 of 30 two-process runs (std::terminate), none after
            gc.collect()


def training_tokens(args, cfg, log=lambda line: None):
    """The token stream of --data (tokenized once into --data-cache) by the run's tokenizer, which this resolves
    into args.tokenizer (the --init folder's own when it has one) and args.eos_id (for --doc-mask)."""
    # the --init folder's tokenizer, or that of the run of an --init checkpoint, when it is there
    own = read_json(Path(args.init, "meta.json")).get("tokenizer") if init_checkpoint(args) else args.init
    own = own if own and (Path(own).is_file() or Path(own, "tokenizer.json").is_file()) else None
    args.tokenizer = args.tokenizer or own   # resolved, absolute: the export copies its files, from wherever it runs
    args.tokenizer = args.tokenizer and str(Path(args.tokenizer).absolute())
    if args.init and not args.tokenizer:
        log(f"--init {args.init} has no tokenizer: the text is read as UTF-8 bytes (257 tokens); give --tokenizer "
            "for the model's own")
    tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    args.eos_id = tokenizer.eos_id
    require(cfg.vocab_size >= tokenizer.vocab_size, f"the tokenizer ({args.tokenizer or 'bytes'}) has "
            f"{tokenizer.vocab_size} tokens, more than the model's vocab_size={cfg.vocab_size}; give a config "
            f"with vocab_size >= {tokenizer.vocab_size} or the model's own tokenizer")
    return token_store(args.data, tokenizer, args.text_field, args.data_cache, args.data_workers, log=log)


def config_dict(cfg) -> dict:
    """The config as it reads back from JSON (tuples become lists), to compare with a saved one."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def on_lead(parallel: Parallel, work):
    """work() on rank 0 alone (the run folder is rank 0's); its result, or its ConfigError, reaches every rank,
    so that all ranks go on or stop alike."""
    outcome = [None, None]
    if parallel.rank == 0:
        try:
            outcome[0] = work()
        except ConfigError as err:
            outcome[1] = str(err)
    if parallel.world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1]:
        raise ConfigError(outcome[1])
    return outcome[0]


def join_processes(args, out: Path) -> bool:
    """Join torchrun's process group when launched by it and not joined yet (gloo on CPU, NCCL on CUDA, its
    communicator made now, on this process's GPU: device_id). Every group's waits, the device mesh's groups made
    later included, time out after --dist-timeout, and each records its recent collectives (torch's flight recorder),
    which NCCL's watchdog writes under <out>/comm-trace on a timeout (`timed_out_line` does on CPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return False
    timeout, device = timedelta(seconds=args.dist_timeout), None
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout   # new_group's default: else torch's 30 / 10 min
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ.setdefault(name, "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(out.absolute() / "comm-trace" / "rank_"))
    if args.device.startswith("cuda"):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device else "gloo", timeout=timeout, device_id=device)
    return True


class TimedOut(ConfigError):
    """A wait for other ranks ran past --dist-timeout; every rank that timed out says so (main)."""


def layout(args) -> tuple[Parallel, torch.device]:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not dist.is_initialized() and device.index is not None:
            torch.cuda.set_device(device)   # Triton launches, streams and graphs use the current device
        device = torch.device("cuda", torch.cuda.current_device())
    parallel = Parallel.build(args.pp, args.dp, args.cp, args.ep, device.type, args.dp_replicate)
    check_layout(args, parallel)
    return parallel, device


def check_layout(args, parallel: Parallel):
    """LayoutError for a layout the run's flags cannot use (parallel: a built one, or a plan without a mesh)."""
    if parallel.cp > 1 and (args.doc_mask or args.compile):
        raise LayoutError(f"--cp={parallel.cp} does not work with --{'doc-mask' if args.doc_mask else 'compile'} (ring "
                          "attention masks by position only, and passes blocks between compiled graphs); drop one")
    if args.batch_size % parallel.data_ranks:
        raise LayoutError(f"--batch-size={args.batch_size} cannot be split over dp x ep = {parallel.data_ranks} data "
                          f"ranks; choose a multiple of {parallel.data_ranks}")
    share = args.batch_size // parallel.data_ranks
    if args.micro_batch_size and share % args.micro_batch_size:
        raise LayoutError(f"--micro-batch-size={args.micro_batch_size} does not divide the {share} sequences of each "
                          f"data rank (--batch-size={args.batch_size} over {parallel.data_ranks} data ranks); choose a "
                          f"divisor of {share}")
    if parallel.pp > 1:
        schedule(parallel.pp, share // micro_batch_size(args, parallel), 0)   # enough micro-batches, or LayoutError


def build_model(model_cls, cfg, parallel: Parallel, device: torch.device, dtype: torch.dtype, seed: int,
                seq_len: int, balance: str | None = None, micro_batches: int = 1, held: list[int] | None = None,
                capacity_factor: float | None = None):
    """The model for this rank's share of the layout, computing in dtype with fp32 master weights: built on the
    meta device (only the `held` layers: a pipeline rank's), checked against the layout, sharded, then
    materialized on `device` and initialized there, so a rank allocates only what it holds (plus one full tensor
    at a time while drawing it), nothing on the host. capacity_factor: each LoadBalance's (None: dropless)."""
    with torch.device("meta"):
        model = model_cls(cfg, parallel, **({"balance": balance} if balance else {}), micro_batches=micro_batches,
                          held_layers=held)
    check_model(model)
    moe = moe_layers(model)
    require(moe, f"all {cfg.num_hidden_layers} layers of the model are dense, none MoE; raise --layers")
    for balance in (m for m in model.modules() if isinstance(m, LoadBalance)):
        balance.capacity_factor = capacity_factor
    parallel.check_model(cfg.num_hidden_layers, moe[0].num_experts, seq_len)
    shard_model(model, parallel, param_dtype=dtype)
    if parallel.world == 1 and micro_batches > 1:
        pair_expert_wgrads(model)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def one_process_step(args):
    """train_on's model, optimizer and step on one process, without its data store, log or checkpoints (for the
    skills' scripts and tests that drive steps themselves): -> (model, step), where step(number, input_ids,
    labels) sets the learning rate of the run's schedule at step `number` (from 1) and runs train_step."""
    check_args(args)
    parallel, device = layout(args)
    require(parallel.world == 1, f"one process only here, not {parallel.world}: leave out --dp, --ep, --pp and --cp")
    model = build_model(MODELS[args.model][1], model_config(args), parallel, device, compute_dtype(args, device),
                        args.seed, args.seq_len, args.balance, micro_batches_per_rank(args, parallel),
                        capacity_factor=args.capacity_factor)
    optimizer, graph = prepare_step(args, parallel, device, model)

    def step(number: int, input_ids, labels):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(number - 1, args.lr, args.warmup, args.steps, args.schedule)
        return train_step(args, parallel, device, model, optimizer, number, input_ids, labels, graph)
    return model, step


def compute_dtype(args, device: torch.device) -> torch.dtype:
    return DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]


def micro_batches_per_rank(args, parallel: Parallel) -> int:
    return args.batch_size // (micro_batch_size(args, parallel) * parallel.data_ranks)


def prepare_step(args, parallel: Parallel, device: torch.device, model) -> tuple:
    """What a built model needs before its first step: what it recomputes (--recompute), its dense stages compiled
    (--compile; by default on CUDA without context parallelism), the optimizer (--optimizer: AdamW, or Muon for the
    hidden matrices), the FP8 weight cache under --fp8 and the step's CUDA graph (step_graph); -> (optimizer, graph
    or None)."""
    recompute_stages(model, args.recompute)   # before the compile, which then compiles the recomputed stages
    if args.compile if args.compile is not None else device.type == "cuda" and parallel.cp == 1:
        compile_stages(model)
    optimizer = muon(model, hidden_matrices(model), args.lr, args.weight_decay, args.muon_momentum, args.nesterov,
                     args.ns_steps) if args.optimizer == "muon" else adamw(model, args.lr, args.weight_decay)
    if micro_batches_per_rank(args, parallel) > 1:
        keep_compute_copies(model, optimizer)   # the optimizer writes the bf16 copies (one-process mixed precision)
    if args.fp8:
        cache = Fp8WeightCache(keep=not parallel.sharded).watch(optimizer)   # FSDP2 gathers each use anew
        use_fp8(model, cache, dense=args.fp8 == "all")
    return optimizer, step_graph(args, parallel, device, model, optimizer)


def micro_batch_size(args, parallel: Parallel) -> int:
    return args.micro_batch_size or args.batch_size // parallel.data_ranks


def micro_batches_of(args, parallel: Parallel, input_ids, labels):
    """This rank's micro-batches of a global batch. Micro-batch j is the same rows of the global batch under
    every layout (size x data ranks rows from row j x that), of which data rank r reads the r-th share; of those
    rows a context-parallel rank takes its zigzag part of the columns."""
    size, cp = micro_batch_size(args, parallel), parallel.cp
    part = (lambda rows: rows) if cp == 1 else functools.partial(zigzag_part, cp=cp, rank=parallel.coords["cp"])
    for first in range(0, args.batch_size, size * parallel.data_ranks):
        rows = slice(first + parallel.data_rank * size, first + (parallel.data_rank + 1) * size)
        yield part(input_ids[rows]), part(labels[rows])


def train_on(args, cfg, parallel: Parallel, device: torch.device, data, folder, run_id: str,
             resume_from: Path | None) -> list[float]:
    """data: (training tokens, held-out tokens)."""
    stream, held_out = data
    torch.manual_seed(args.seed)   # the global generators (CPU and CUDA, checkpointed) start alike in every run
    micro_batches, dtype = micro_batches_per_rank(args, parallel), compute_dtype(args, device)
    pipeline, held = None, None
    if parallel.pp > 1:
        chunks = chunk_layers(cfg.num_hidden_layers, parallel.pp,
                              args.chunk_layers and [int(n) for n in args.chunk_layers.split(",")])
        held = held_layers(chunks, parallel.coords["pp"])
    model = build_model(MODELS[args.model][1], cfg, parallel, device, dtype, args.seed, args.seq_len, args.balance,
                        micro_batches, held, args.capacity_factor)
    if parallel.pp > 1:
        pipeline = Pipeline(model, parallel, dtype, chunks, defer_wgrad=True,
                            overlap=parallel.ep > 1 and args.overlap is not False)   # --no-overlap: one side at a time
    if args.init and not resume_from:   # a resumed run's weights come from its checkpoint
        init_from_hf(args, model)
    optimizer, graph = prepare_step(args, parallel, device, model)
    from pith_apps.run_folder import LossWatch, checkpoint_bytes, require_finite_weights, save
    batches = batch_settings(args, stream, held_out)
    resumed = restore(args, resume_from, model, optimizer, cfg, batches, folder, parallel) if resume_from else None
    start, watch = resumed["step"] if resumed else 0, LossWatch(resumed)
    require(start <= args.steps, f"the checkpoint is at step {start}, past --steps {args.steps}; give --steps above "
            f"{start} to train on from it")
    size, weights = checkpoint_bytes(model, optimizer, parallel)
    saves = len({s for s in range(start + 1, args.steps + 1) if s % args.save_every == 0} | {args.steps}) \
        if args.save_every and start < args.steps else 0
    export = (args.export_hf, weights * dtype.itemsize) if args.export_hf else None
    on_lead(parallel, lambda: folder.check_space(size, saves, export))
    on_lead(parallel, folder.begin)   # every check passed: only now is a run that --overwrite replaces deleted
    lead = parallel.rank == 0
    losses, speeds, evals = [], [], []
    progress = make_progress(start, args) if lead else lambda loss, tokens_per_s, held_out: None
    hf_config, peak = hf_config_data(args), args.peak_tflops or peak_tflops(device)
    saved_meta = dict(run=run_id, config=config_dict(cfg), layout=dict(pp=parallel.pp, dp=parallel.dp, cp=parallel.cp, ep=parallel.ep,
                                                                       dp_replicate=parallel.dp_replicate),
                      model=args.model, hf_config=hf_config, tokenizer=args.tokenizer, batches=batches,
                      optimizer=args.optimizer)
    with StopSignals(folder.checkpoints) as signals, RunLog(folder.tb, start, lead, args.image_every) as log:
        for step in range(start, args.steps):
            tic = time.perf_counter()
            lr = lr_at(step, args.lr, args.warmup, args.steps, args.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            input_ids, labels = batch_at(stream, step, args.seed, args.batch_size, args.seq_len)
            loss_value, norm, stop, routing = train_step(args, parallel, device, model, optimizer, step + 1, input_ids,
                                                         labels, graph, pipeline, lambda: signals.asked is not None)
            dead = step == start and watch.dead_line(loss_value, cfg.vocab_size)
            if dead:
                raise NonFinite(f"step {step + 1}: {dead}", before=start)
            tokens_per_s = args.batch_size * args.seq_len / (time.perf_counter() - tic)
            losses.append(loss_value)
            speeds.append(tokens_per_s)
            scalars = dict(loss=loss_value, lr=lr, grad_norm=norm, tokens_per_s=tokens_per_s)
            if routing is not None:   # the slots routed (not absent) per token, mean over MoE layers
                scalars["experts_per_token"] = routing[0].sum(1).mean().item() / (args.batch_size * args.seq_len)
            if peak:   # tokens_per_s is the global batch's: each process's share against one GPU's peak
                flops = flops_per_token(hf_config, args.seq_len, scalars.get("experts_per_token"))
                scalars["mfu_pct"] = 100 * tokens_per_s / parallel.world * flops / (peak * 1e12)
            if device.type == "cuda":
                scalars["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            log.step(step + 1, scalars, routing, last=step + 1 == args.steps or stop)
            evaluated = args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps)
            if evaluated:
                evals.append(evaluate(args, parallel, device, model, held_out, pipeline))
                log.eval(step + 1, evals[-1])
            progress(loss_value, tokens_per_s, evals[-1] if evaluated else None)
            if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps or stop):
                require_finite_weights(model, parallel, step + 1)
                save(folder, step + 1, model, optimizer, saved_meta | watch.judged(losses), size)
                if lead and watch.rose_now:
                    print(f"step {step + 1}: saved after the loss rose; if it does not come back down, stop the run: "
                          f"{folder.way_back(run_id, args.lr)}")
            if stop:
                if lead:
                    saved = f"checkpoint step-{step + 1:08d}" if args.save_every else "no checkpoint (--save-every 0)"
                    print(f"stopped by {signals.asked or 'a signal to another rank or the death of its torchrun'} after step {step + 1}: {saved}; "
                          f"continue with --resume")
                break
    if args.export_hf and start + len(losses) == args.steps:
        export_hf(args, parallel, model, dtype)
    if lead:
        if losses:
            memory = (f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
                      if device.type == "cuda" else "")
            print(f"trained steps {start + 1}-{start + len(losses)}: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
                  f"(mean of last {len(losses[-10:])}: {sum(losses[-10:]) / len(losses[-10:]):.3f}), "
                  f"{sorted(speeds)[len(speeds) // 2]:,.0f} tokens/s (median step){memory}; "
                  f"{f'held-out loss {evals[-1]:.3f} (perplexity {math.exp(min(evals[-1], 700)):.2f}), ' if evals else ''}"
                  f"{'checkpoints ' + str(folder.checkpoints) + ', ' if args.save_every else ''}"
                  f"TensorBoard logs {folder.tb}")
        else:
            print(f"nothing to train: the run is at step {start} of --steps {args.steps}; raise --steps to go on")
    return losses


def train_step(args, parallel: Parallel, device, model, optimizer, number: int, input_ids, labels,
               graph: StepGraph | None = None, pipeline: Pipeline | None = None, stop_asked=lambda: False):
    """Optimizer step `number` (from 1) on a global batch, its micro-batches' gradients accumulated (through `graph`,
    a StepGraph of gradient_step, when given; through `pipeline` on several pipeline ranks). Returns the step's
    loss, the gradient norm before the clip, whether any rank was asked to stop (the same on every rank: stop_asked()
    read after the step's work, so that a signal during it stops the run after this step, not the next) and the
    step's routing (update_expert_bias; the whole model's); ConfigError when the loss or the gradients are not
    finite, the update skipped (before anything is saved). The learning rate is the optimizer's groups' (train_on
    sets one for all), passed in as a tensor so that a replay follows it."""
    lr = torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float32)
    if device.type == "cuda":   # copies that do not wait: a blocking one waits for the GPU to drain
        input_ids, labels, lr = (t.pin_memory().to(device, non_blocking=True) for t in (input_ids, labels, lr))
    try:
        loss, norm = (graph or functools.partial(gradient_step, args, parallel, model, optimizer, pipeline=pipeline))(
            input_ids, labels, lr)
    except CaptureError as err:
        raise ConfigError(f"step {number}: {err}; nothing of this step was saved: run again with --no-cuda-graph "
                          "(and --resume to continue from the last checkpoint, or --overwrite to start over)") from None
    routing = update_expert_bias(model)
    if parallel.pp > 1:
        routing = whole_model_routing(parallel, model, routing)
    totals = torch.stack([loss, torch.tensor(float(stop_asked()), device=device)])
    if parallel.world > 1:   # one all-reduce: losses add up over data ranks, a stop asked of any rank shows
        dist.all_reduce(totals)
    loss_value, stop, norm_value = torch.cat([totals, norm.view(1)]).tolist()
    if not math.isfinite(loss_value) or not math.isfinite(norm_value):
        what = f"the loss became {loss_value}" if not math.isfinite(loss_value) else \
            f"the gradients became non-finite (the loss was {loss_value:.4g})"
        raise NonFinite(f"step {number}: {what}; the update was skipped and nothing of it was saved", number - 1)
    return loss_value, norm_value, stop > 0, routing


def step_graph(args, parallel: Parallel, device, model, optimizer) -> StepGraph | None:
    """The CUDA graph of gradient_step that train_step replays, where --cuda-graph asks for one (default: one
    process on CUDA); None: each step runs eagerly."""
    if args.cuda_graph if args.cuda_graph is not None else device.type == "cuda" and parallel.world == 1:
        return StepGraph(functools.partial(gradient_step, args, parallel, model, optimizer))
    return None


def gradient_step(args, parallel: Parallel, model, optimizer, input_ids, labels, lr, pipeline: Pipeline | None = None):
    """What a step does on the device: each micro-batch's forward and backward (in DualPipeV order through
    `pipeline`, the loss then on pipeline rank 0 alone), the clip and the update at learning rate lr (a 0-dim
    tensor); returns the loss and the gradient norm before the clip, as device tensors. It never waits for the
    host, so that a CUDA graph can capture it (StepGraph)."""
    tokens = (labels != -100).sum()   # of the global batch: each micro-batch's loss is its share of the mean
    micro_batches = [(ids, targets, documents_of(args, ids))
                     for ids, targets in micro_batches_of(args, parallel, input_ids, labels)]
    if pipeline is not None:
        loss = pipeline.step(micro_batches, tokens)
    else:
        loss = torch.zeros((), device=input_ids.device)
        for index, (ids, targets, docs) in enumerate(micro_batches, 1):
            micro_loss = model.loss_sum(ids, targets, docs) / tokens
            if index == len(micro_batches):
                drop_compute_copies(model)   # the backward below frees each bf16 copy once its layer is done
            micro_loss.backward()
            loss += micro_loss.detach()
    if model.wgrad_pairs is not None:
        model.wgrad_pairs.flush()   # an odd micro-batch's expert weight gradients still wait for their pair
    norm = grad_norm(model.parameters(), parallel)
    clipped_step(optimizer, norm, args.clip, lr)
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


def documents_of(args, ids):
    """With --doc-mask, the document index of each token (each token sees only its own document); else None."""
    return document_ids(ids, args.eos_id) if args.doc_mask else None


@torch.no_grad()
def evaluate(args, parallel: Parallel, device, model, held_out, pipeline: Pipeline | None = None) -> float:
    """Mean loss per token over the held-out batches, the same on every rank (each data rank its rows; through
    `pipeline`, each sum on pipeline rank 0)."""
    totals = torch.zeros(2, device=device)
    counts = parallel.coords["pp"] == 0   # where the loss is
    for index in range(args.eval_batches):
        input_ids, labels = held_out_batch(held_out, index, args.batch_size, args.seq_len)
        for ids, targets in micro_batches_of(args, parallel, input_ids.to(device), labels.to(device)):
            docs = documents_of(args, ids)
            totals[0] += pipeline.loss_sum(ids, targets, docs) if pipeline else model.loss_sum(ids, targets, docs)
            totals[1] += (targets != -100).sum() * counts
    release_forward_weights(model)   # (a replayed step, StepGraph, updates the weights without the hook that drops copies)
    if parallel.world > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def whole_model_routing(parallel: Parallel, model, routing):
    """A pipeline rank's routing (update_expert_bias: loads of its MoE layers, their aux loss; None without MoE
    layers) joined with the other pipeline ranks' into the whole model's, layers in model order."""
    numbers = [n for n, layer in model.layers.items() if layer.is_moe]
    parts = [None] * parallel.pp
    dist.all_gather_object(parts, (numbers, *(t.cpu() for t in routing)) if routing else None, group=parallel.group("pp"))
    parts = [part for part in parts if part is not None]
    if not parts:
        return None
    order = torch.tensor([n for part in parts for n in part[0]]).argsort()
    device = next(model.parameters()).device
    return torch.cat([part[1] for part in parts])[order].to(device), sum(part[2] for part in parts).to(device)


def init_from_hf(args, model):
    """--init: every process reads its part of the weights (any layout): of the Hugging Face folder only the slices
    its shards hold, or of a checkpoint of the app the entries they need."""
    from pith_engine import checkpoint
    if not init_checkpoint(args):
        from pith_apps.hf_checkpoint import absent_line, load_hf_weights
        absent = load_hf_weights(model, args.init)
        if absent and model.parallel.rank == 0:   # tensors the files lack and may: kept as initialized
            print(absent_line(absent, args.init))
        return
    try:
        checkpoint.load_weights(args.init, model)
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"--init: {err}") from None


def export_hf(args, parallel: Parallel, model, dtype: torch.dtype):
    """The trained model as a Hugging Face folder, with the tokenizer's files when it has a tokenizer.json: every
    process writes its own part of the weights (hf_checkpoint.save_hf)."""
    from pith_apps.convert import tokenizer_files
    from pith_apps.hf_checkpoint import save_hf
    try:
        save_hf(model, hf_config_data(args), args.export_hf, dtype=dtype, extra_files=tokenizer_files(args.tokenizer))
    except OSError as err:
        raise ConfigError(f"--export-hf {args.export_hf}: could not write it ({err.strerror or err}); the run and its "
                          "checkpoints are intact") from None
    if parallel.rank == 0:
        print(f"exported the model to {args.export_hf}")


def batch_settings(args, stream, held_out) -> dict:
    """What decides each step's global batch (batch_at: the step's samples of the seed's epoch order of the
    training tokens), by the flags that set it."""
    return {"--seq-len": args.seq_len, "--batch-size": args.batch_size, "--seed": args.seed,
            "dataset tokens (--data, --text-field, --tokenizer)": len(stream) + len(held_out),
            "held-out tokens (--eval-every, --eval-batches)": len(held_out)}


def restore(args, path: Path, model, optimizer, cfg, batches: dict, folder, parallel: Parallel) -> dict:
    """Load the checkpoint at path; returns its meta. A damaged one stops the run, naming the newest intact; one
    whose run read other batches (batch_settings) is refused: its later steps would read other samples, some
    perhaps trained on already, or held out."""
    from pith_engine import checkpoint
    try:
        meta = checkpoint.read_meta(path)
        require(meta.get("config") == config_dict(cfg), f"checkpoint '{path}' was trained with another model config "
                f"({meta.get('model', 'unknown family')}; this run: {args.model}): " + (
                    "give --resume-from a checkpoint of this model config" if args.resume_from else
                    "use another --out, or replace its run with --overwrite"))
        saved = meta.get("batches", {})   # (not in checkpoints written before it was recorded)
        changed = [f"{name} {saved[name]} (now {value})" for name, value in batches.items()
                   if name in saved and saved[name] != value]
        require(not changed, f"checkpoint '{path}' was trained with {', '.join(changed)}: resume with its values, "
                f"or start a new run from its weights: --init {path} (and another --out)")
        kind = type(optimizer).__name__.lower()   # AdamW or Muon: the state the checkpoint must hold
        require(meta.get("optimizer", "adamw") == kind, f"checkpoint '{path}' was trained with --optimizer "
                f"{meta.get('optimizer')}, not {kind}: resume with it, or start a new run from its weights: --init {path}")
        meta = checkpoint.load(path, model, optimizer)
        trained = int(next(iter(optimizer.state.values()))["step"])   # the optimizer counts the steps the run took
        if trained != meta["step"]:
            raise checkpoint.CheckpointError(f"checkpoint '{path}' is damaged: its meta.json names step {meta['step']}, "
                                             f"its optimizer state step {trained}")
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"{err}; {on_lead(parallel, lambda: folder.good_one(skip=path))}") from None
    if parallel.rank == 0:
        print(f"resumed from {path} at step {meta['step']} (saved under {meta['layout']})")
    return meta


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.print_config:
            check_args(args)
            print(run_config_text(args), end="")
            return
        train(args)
    except (ConfigError, LayoutError) as err:
        if int(os.environ.get("RANK", "0")) == 0 or isinstance(err, TimedOut):   # one says why, but each its own wait
            print(f"pith-train: error: {err}", file=sys.stderr)
        else:   # torchrun stops every worker once one exits: give rank 0 time to reach its line
            time.sleep(2)
        sys.exit(2)
    except KeyboardInterrupt:   # before the first step or after the last (during them, StopSignals takes Ctrl-C)
        print("pith-train: interrupted; the checkpoints written so far are intact", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as err:   # torch.OutOfMemoryError (CUDA) is one; the CPU allocator raises a plain one
        if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in str(err):
            raise
        rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""   # the rank that ran out says so
        print(f"pith-train: error: out of memory{rank}: {str(err).strip().splitlines()[0]}; lower "
              "--micro-batch-size or --seq-len, or spread the model over more GPUs (--ep, --pp, --dp): "
              "skills/pith-apps/estimate-memory tells what a layout needs", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
