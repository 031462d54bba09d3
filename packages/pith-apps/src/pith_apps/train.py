"""The Pith training app: `hatch run apps:train qwen3` (or `python -m pith_apps.train qwen3`), and on several
processes `torchrun --nproc-per-node N -m pith_apps.train qwen3 --ep 2 ...` with the same flags.

Reads a model config (a preset or a config.json), builds the model for this rank's share of the layout,
streams batches from a text dataset (each data rank reads its share of every global batch), and trains
with AdamW, showing a progress bar, writing TensorBoard scalars to <out>/tb and atomic distributed
checkpoints to <out>/checkpoints that --resume continues from, under the same or another layout.
"""
import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pith_apps.config import ConfigError, read_json, require
from pith_apps.data import DEFAULT_CORPUS, ByteTokenizer, HFTokenizer, batch_at, load_token_stream
from pith_apps.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from pith_apps.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from pith_apps.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from pith_engine.compile import compile_stages
from pith_engine.data_parallel import clip_grad_norm, drop_compute_copies, local_part, shard_model
from pith_engine.moe import BALANCE_MODES, update_expert_bias
from pith_engine.optim import SCHEDULES, adamw, lr_at
from pith_engine.parallel import LayoutError, Parallel

MODELS = {"qwen3": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
          "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
          "gpt_oss": (GptOssConfig, GptOssForCausalLM)}
FAMILY_OF = {"qwen3_moe": "qwen3", "deepseek_v2": "deepseek_v2", "gpt_oss": "gpt_oss"}   # config model_type -> family
PRESETS = Path(__file__).parent / "presets"
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")   # copied beside tokenizer.json on export
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


DESCRIPTION = ("Train a Qwen3-MoE, DeepSeek-V2 or GPT-OSS model on a text dataset with AdamW, showing a progress "
               "bar, logging to TensorBoard and checkpointing so that --resume continues the run.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pith-train", description=DESCRIPTION)
    add = parser.add_argument
    add("model", nargs="?", help=f"The model family to train: {', '.join(MODELS)}.")
    add("--run-config", metavar="FILE.toml", help="A TOML file whose keys are these flags' names (model, preset, "
        "batch-size, ...); flags given on the command line override it.")
    add("--print-config", action="store_true", help="Print the resolved run as a TOML file for --run-config and exit.")
    add("--preset", default="tiny", help="The size of the model, a config in pith_apps/presets (default: tiny).")
    add("--config", help="A Hugging Face config.json to use instead of the preset.")
    add("--init", metavar="DIR", help="Start from the Hugging Face model folder DIR: its config.json (instead of "
        "--preset and --config), its safetensors weights and, unless --tokenizer is given, its tokenizer.json. "
        "One process only, for now.")
    add("--layers", type=int, help="Keep only the first N decoder layers of the config, for experiments.")
    add("--data", default=str(DEFAULT_CORPUS), help="A .txt, .jsonl, .json, .parquet or .arrow file, or a folder of "
        "files of one of those kinds, to train on (default: the small corpus bundled with the app).")
    add("--text-field", default="text", help="The column of a .jsonl, .json, .parquet or .arrow dataset that holds "
        "the documents; a .txt file's lines are its documents (default: text).")
    add("--export-hf", metavar="DIR", help="At the end of the run, write the trained model to DIR as a Hugging Face "
        "folder: config.json, safetensors weights in the compute dtype and the tokenizer's files. One process only, "
        "for now.")
    add("--tokenizer", metavar="PATH", help="A Hugging Face tokenizer.json, or a folder holding one (and its "
        "tokenizer_config.json, which names the end-of-document token); default: UTF-8 bytes, 257 tokens.")
    add("--out", help="The run folder for TensorBoard logs and checkpoints (default: runs/<model>-<preset>).")
    add("--steps", type=int, default=300, help="The number of optimizer steps of the run (default: 300).")
    add("--batch-size", type=int, default=16, help="Sequences per optimizer step, over all data ranks (default: 16).")
    add("--micro-batch-size", type=int, help="Sequences per forward and backward on each data rank; the gradients "
        "of batch-size / (micro-batch-size x data ranks) micro-batches are accumulated (default: one micro-batch).")
    add("--seq-len", type=int, default=128, help="Tokens per training sequence (default: 128).")
    add("--lr", type=float, default=3e-3, help="The peak learning rate of AdamW (default: 0.003).")
    add("--warmup", type=int, default=30, help="Steps of linear learning-rate warmup (default: 30).")
    add("--schedule", default="cosine", help=f"The learning-rate schedule after warmup: {', '.join(SCHEDULES)} "
        "(default: cosine).")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices; norms and biases have "
        "none (default: 0.1).")
    add("--clip", type=float, default=1.0, help="The global gradient norm is clipped to this (default: 1.0).")
    add("--seed", type=int, default=0, help="Seeds the initial weights and the order of the data (default: 0).")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="The device to train on: cpu, cuda "
        "or cuda:N (default: cuda when torch sees a GPU, else cpu).")
    add("--dtype", choices=DTYPES, help="The compute dtype; weights, gradients and optimizer state are always "
        "float32 (default: bfloat16 on CUDA, float32 on CPU).")
    add("--compile", action=argparse.BooleanOptionalAction, help="Compile the dense stages with torch.compile "
        "(default: on for CUDA, off on CPU, where it costs minutes).")
    add("--balance", help="Expert load balancing: " + ", ".join(BALANCE_MODES) + " (default: the family's own, "
        "sequence for DeepSeek-V2 with seq_aux, else global_batch).")
    for dim, meaning in (("dp", "data (FSDP2)"), ("ep", "expert"), ("pp", "pipeline (validated, not built yet)"),
                         ("cp", "context (validated, not built yet)")):
        add(f"--{dim}", type=int, default=1, help=f"The {meaning}-parallel size; the product of the four sizes "
            "must be the number of processes (default: 1).")
    add("--save-every", type=int, default=100, help="Checkpoint every N steps and at the end; 0 saves nothing, for "
        "a measurement rather than a run to keep (default: 100).")
    add("--resume", action="store_true", help="Continue from the newest checkpoint in <out>/checkpoints.")
    add("--resume-from", metavar="STEP|PATH", help="Continue from the checkpoint of that step in <out>/checkpoints, "
        "or from a checkpoint folder.")
    add("--overwrite", action="store_true", help="Replace the run that <out> holds; its checkpoints and TensorBoard "
        "logs are deleted.")
    add("--quiet", action="store_true", help="Show no progress bar.")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, over the values of --run-config where one is given; ConfigError for a bad file."""
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.run_config:
        parser.set_defaults(**read_run_config(known.run_config, parser))
    return parser.parse_args(argv)


KIND_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def read_run_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """The values of a TOML run config, by flag destination, each checked as the flag would check it."""
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"--run-config {path}: cannot read it as TOML ({err})") from None
    actions = {action.dest: action for action in parser._actions
               if action.dest not in ("help", "run_config", "print_config")}
    values = {}
    for key, value in data.items():
        action = actions.get(key.replace("-", "_"))
        require(action is not None, f"--run-config {path}: unknown key '{key}'; valid keys: "
                f"{', '.join(sorted(a.replace('_', '-') for a in actions))}")
        kind = bool if action.nargs == 0 else action.type or str   # nargs 0: a switch such as --resume
        if kind is float and type(value) is int:
            value = float(value)
        require(type(value) is kind, f"--run-config {path}: '{key}' = {value!r} must be {KIND_WORDS[kind]}")
        require(action.choices is None or value in action.choices,
                f"--run-config {path}: '{key}' = {value!r} is not one of {', '.join(action.choices or ())}")
        values[action.dest] = value
    return values


def run_config_text(args: argparse.Namespace) -> str:
    """args as a TOML run config (flags left unset are left out)."""
    lines = []
    for dest, value in vars(args).items():
        if value is not None and dest not in ("run_config", "print_config"):
            text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            lines.append(f"{dest.replace('_', '-')} = {text}")
    return "\n".join(lines) + "\n"


def check_args(args):
    require(args.model is not None, f"no model family given; valid: {', '.join(MODELS)} (as the first argument or "
            "the key 'model' of --run-config)")
    require(args.model in MODELS, f"unknown model '{args.model}'; valid models: {', '.join(MODELS)}")
    require(args.schedule in SCHEDULES, f"unknown --schedule '{args.schedule}'; valid: {', '.join(SCHEDULES)}")
    require(args.balance in (None, *BALANCE_MODES), f"unknown --balance '{args.balance}'; valid: {', '.join(BALANCE_MODES)}")
    require(args.save_every >= 0, f"--save-every={args.save_every} must be >= 0 (0: no checkpoints)")
    require(not (args.overwrite and (args.resume or args.resume_from)),
            "--overwrite starts the run over; it cannot go with --resume or --resume-from")
    for flag in ("steps", "batch_size", "seq_len", "micro_batch_size", "layers"):
        value = getattr(args, flag)
        require(value is None or value > 0, f"--{flag.replace('_', '-')}={value} must be a positive integer")
    require(args.lr > 0 and args.clip > 0, f"--lr={args.lr} and --clip={args.clip} must be > 0")
    require(args.warmup >= 0 and args.weight_decay >= 0, "--warmup and --weight-decay must be >= 0")
    require(args.device in ("cpu", "cuda") or args.device.startswith("cuda:"),
            f"unknown --device '{args.device}'; valid: cpu, cuda, cuda:N")
    require(not args.device.startswith("cuda") or torch.cuda.is_available(),
            f"--device {args.device} asked for, but torch sees no CUDA device; use --device cpu")


def model_config(args):
    return MODELS[args.model][0].from_dict(hf_config_data(args))


def hf_config_data(args) -> dict:
    """The Hugging Face config the run's model is built from (preset, --config or --init, cut to --layers)."""
    require(not (args.init and args.config), "--init DIR takes the model's config from DIR/config.json; leave out "
            "--config")
    if args.init:
        require(Path(args.init, "config.json").is_file(), f"--init '{args.init}' has no config.json; give a Hugging "
                "Face model folder (config.json and *.safetensors)")
    path = Path(args.init, "config.json") if args.init else Path(args.config or PRESETS / f"{args.model}_{args.preset}.json")
    valid = sorted(p.stem.removeprefix(f"{args.model}_") for p in PRESETS.glob(f"{args.model}_*.json"))
    require(args.config or args.init or path.is_file(), f"unknown --preset '{args.preset}' for {args.model}; valid presets: "
            f"{', '.join(valid)}")
    data = read_json(path)
    model_type = data.get("model_type")
    family = FAMILY_OF.get(model_type, args.model if model_type is None else None)
    require(family is not None, f"config '{path}' has model_type {model_type!r}, which Pith does not train; valid: "
            + ", ".join(f"{kind} ({name})" for kind, name in FAMILY_OF.items()))
    require(family == args.model, f"config '{path}' is a {family} config (model_type {model_type!r}), not {args.model}; "
            f"run: pith-train {family} --config {path}")
    if args.layers:
        layers = data.get("num_hidden_layers")
        require(isinstance(layers, int) and args.layers <= layers,
                f"--layers={args.layers} must be at most the config's num_hidden_layers={layers}")
        data |= {"num_hidden_layers": args.layers} | (
            {"layer_types": data["layer_types"][:args.layers]} if "layer_types" in data else {})
    return data


def train(args) -> list[float]:
    """Run the training loop; returns the loss of every step run (the same on every rank)."""
    check_args(args)
    cfg = model_config(args)
    own = args.init if args.init and Path(args.init, "tokenizer.json").is_file() else None
    args.tokenizer = args.tokenizer or own   # resolved: the export copies its files
    tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    require(cfg.vocab_size >= tokenizer.vocab_size, f"the tokenizer ({args.tokenizer or 'bytes'}) has "
            f"{tokenizer.vocab_size} tokens, more than the model's vocab_size={cfg.vocab_size}; give a config "
            f"with vocab_size >= {tokenizer.vocab_size} or the model's own tokenizer")
    stream = load_token_stream(args.data, tokenizer, args.text_field)
    joined = join_processes(args)
    from pith_apps.run_folder import RunFolder   # heavy import (DCP, DTensor: ~0.8 s): only when training
    folder = RunFolder(args.out or f"runs/{args.model}-{args.preset}")
    try:
        parallel, device = layout(args)
        for flag, value in (("--init", args.init), ("--export-hf", args.export_hf)):
            require(not value or parallel.world == 1, f"{flag} on {parallel.world} processes is not built yet; "
                    "run it on one process")
        run_id, resume_from = on_lead(parallel, lambda: folder.open(
            args.model, config_dict(cfg), args.resume, args.resume_from, args.overwrite))
        return train_on(args, cfg, parallel, device, stream, folder, run_id, resume_from)
    finally:
        folder.release()
        if joined:
            dist.destroy_process_group()


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


def join_processes(args) -> bool:
    """Join torchrun's process group when launched by it and not joined yet (gloo on CPU, NCCL on CUDA)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return False
    if args.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    return True


def layout(args) -> tuple[Parallel, torch.device]:
    device = torch.device(args.device)
    if device.type == "cuda" and dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
    parallel = Parallel.build(args.pp, args.dp, args.cp, args.ep, device.type)
    if parallel.pp > 1 or parallel.cp > 1:
        raise LayoutError(f"--pp={parallel.pp} / --cp={parallel.cp}: pipeline and context parallelism are not built "
                          "yet; use --pp 1 --cp 1")
    if args.batch_size % parallel.data_ranks:
        raise LayoutError(f"--batch-size={args.batch_size} cannot be split over dp x ep = {parallel.data_ranks} data "
                          f"ranks; choose a multiple of {parallel.data_ranks}")
    share = args.batch_size // parallel.data_ranks
    if args.micro_batch_size and share % args.micro_batch_size:
        raise LayoutError(f"--micro-batch-size={args.micro_batch_size} does not divide the {share} sequences of each "
                          f"data rank (--batch-size={args.batch_size} over {parallel.data_ranks} data ranks); choose a "
                          f"divisor of {share}")
    return parallel, device


def build_model(model_cls, cfg, parallel: Parallel, device: torch.device, dtype: torch.dtype, seed: int,
                seq_len: int, balance: str | None = None, micro_batches: int = 1):
    """The model for this rank's share of the layout, computing in dtype with fp32 master weights: built on the
    meta device, checked against the layout, sharded, then materialized on `device` and initialized there, so
    a rank allocates only what it holds (plus one full tensor at a time while drawing it), nothing on the host."""
    with torch.device("meta"):
        model = model_cls(cfg, parallel, **({"balance": balance} if balance else {}), micro_batches=micro_batches)
    moe_layers = [layer for layer in model.model.layers if layer.is_moe]
    require(moe_layers, f"all {cfg.num_hidden_layers} layers of the model are dense, none MoE; raise --layers")
    parallel.check_model(cfg.num_hidden_layers, moe_layers[0].num_experts, cfg.num_attention_heads, seq_len)
    shard_model(model, parallel, param_dtype=dtype)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def micro_batch_size(args, parallel: Parallel) -> int:
    return args.micro_batch_size or args.batch_size // parallel.data_ranks


def micro_batches_of(args, parallel: Parallel, input_ids, labels):
    """This rank's micro-batches of a global batch. Micro-batch j is the same rows of the global batch under
    every layout (size x data ranks rows from row j x that), of which data rank r reads the r-th share."""
    size = micro_batch_size(args, parallel)
    for first in range(0, args.batch_size, size * parallel.data_ranks):
        rows = slice(first + parallel.data_rank * size, first + (parallel.data_rank + 1) * size)
        yield input_ids[rows], labels[rows]


def train_on(args, cfg, parallel: Parallel, device: torch.device, stream, folder, run_id: str,
             resume_from: Path | None) -> list[float]:
    torch.manual_seed(args.seed)   # the global generators (CPU and CUDA, checkpointed) start alike in every run
    micro_batches = args.batch_size // (micro_batch_size(args, parallel) * parallel.data_ranks)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model = build_model(MODELS[args.model][1], cfg, parallel, device, dtype, args.seed, args.seq_len, args.balance,
                        micro_batches)
    if args.init and not resume_from:   # a resumed run's weights come from its checkpoint
        from pith_apps.hf_checkpoint import load_hf_weights
        load_hf_weights(model, args.init)
    if args.compile if args.compile is not None else device.type == "cuda":
        compile_stages(model)
    optimizer = adamw(model, args.lr, args.weight_decay)
    if args.save_every:
        size = checkpoint_bytes(model, parallel)
        on_lead(parallel, lambda: folder.check_space(size))
    start = restore(resume_from, model, optimizer, cfg, folder, parallel) if resume_from else 0
    lead = parallel.rank == 0
    from torch.utils.tensorboard import SummaryWriter  # heavy import: only when training
    writer = SummaryWriter(folder.tb) if lead else None
    losses, speeds = [], []
    progress = make_progress(start, args) if lead else lambda loss, tokens_per_s: None
    saved_meta = dict(run=run_id, config=config_dict(cfg), layout=dict(dp=parallel.dp, ep=parallel.ep))
    with StopSignals() as signals:
        for step in range(start, args.steps):
            tic = time.perf_counter()
            lr = lr_at(step, args.lr, args.warmup, args.steps, args.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            input_ids, labels = batch_at(stream, step, args.seed, args.batch_size, args.seq_len)
            loss_value, grad_norm, stop = train_step(args, parallel, device, model, optimizer, step + 1, input_ids,
                                                     labels, signals.asked is not None)
            tokens_per_s = args.batch_size * args.seq_len / (time.perf_counter() - tic)
            losses.append(loss_value)
            speeds.append(tokens_per_s)
            if lead:
                scalars = dict(loss=loss_value, lr=lr, grad_norm=grad_norm.item(), tokens_per_s=tokens_per_s)
                if device.type == "cuda":
                    scalars["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                for name, value in scalars.items():
                    writer.add_scalar(f"train/{name}", value, step + 1)
            progress(loss_value, tokens_per_s)
            if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps or stop):
                save(folder, step + 1, model, optimizer, saved_meta)
            if stop:
                if lead:
                    saved = f"checkpoint step-{step + 1:08d}" if args.save_every else "no checkpoint (--save-every 0)"
                    print(f"stopped by {signals.asked or 'a signal to another rank'} after step {step + 1}: {saved}; "
                          f"continue with --resume")
                break
    if args.export_hf and start + len(losses) == args.steps:
        export_hf(args, model, dtype)
    if lead:
        writer.close()
        if losses:
            memory = (f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
                      if device.type == "cuda" else "")
            print(f"trained steps {start + 1}-{start + len(losses)}: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
                  f"(mean of last 10: {sum(losses[-10:]) / len(losses[-10:]):.3f}), "
                  f"{sorted(speeds)[len(speeds) // 2]:,.0f} tokens/s (median step){memory}; "
                  f"{'checkpoints ' + str(folder.checkpoints) + ', ' if args.save_every else ''}"
                  f"TensorBoard logs {folder.tb}")
    return losses


def train_step(args, parallel: Parallel, device, model, optimizer, number: int, input_ids, labels, stop_asked: bool):
    """Optimizer step `number` (from 1) on a global batch, its micro-batches' gradients accumulated. Returns the
    step's loss, the gradient norm before the clip and whether any rank was asked to stop (loss and stop the same
    on every rank); ConfigError when the loss or the updated weights are not finite (before anything is saved)."""
    tokens = (labels != -100).sum().item()   # of the global batch: each micro-batch's loss is its share of the mean
    if device.type == "cuda":   # one copy a step that does not wait: a blocking one waits for the GPU to drain
        input_ids, labels = (t.pin_memory().to(device, non_blocking=True) for t in (input_ids, labels))
    loss = torch.zeros((), device=device)
    micro_batches = list(micro_batches_of(args, parallel, input_ids, labels))
    for index, (ids, targets) in enumerate(micro_batches, 1):
        micro_loss = model.loss_sum(ids, targets) / tokens
        if index == len(micro_batches):
            drop_compute_copies(model)   # the backward below frees each bf16 copy once its layer is done
        micro_loss.backward()
        loss += micro_loss.detach()
    grad_norm = clip_grad_norm(model.parameters(), args.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update_expert_bias(model)
    weights = torch.stack(torch._foreach_norm([local_part(p.detach()) for p in model.parameters()])).sum()
    totals = torch.stack([loss, weights.to(device), torch.tensor(float(stop_asked), device=device)])
    if parallel.world > 1:   # one all-reduce: losses add up over data ranks, a non-finite weight anywhere shows
        dist.all_reduce(totals)
    loss_value, weights_value, stop = totals.tolist()
    if not math.isfinite(loss_value) or not math.isfinite(weights_value):
        what = f"the loss became {loss_value}" if not math.isfinite(loss_value) else \
            f"the weights became non-finite after the update (the loss was {loss_value:.4g})"
        raise ConfigError(f"step {number}: {what}; nothing of it was saved, the last checkpoint "
                          f"is intact; lower --lr (now {args.lr}) and continue with --resume or --resume-from")
    return loss_value, grad_norm, stop > 0


def export_hf(args, model, dtype: torch.dtype):
    """The trained model as a Hugging Face folder, with the tokenizer's files when it has a tokenizer.json."""
    from pith_apps.hf_checkpoint import save_hf
    extra = {}
    if args.tokenizer:
        path = Path(args.tokenizer)
        file = path / "tokenizer.json" if path.is_dir() else path
        extra = {"tokenizer.json": file} | {name: file.with_name(name) for name in TOKENIZER_FILES
                                            if file.with_name(name).is_file()}
    try:
        save_hf(model, hf_config_data(args), args.export_hf, dtype=dtype, extra_files=extra)
    except OSError as err:
        raise ConfigError(f"--export-hf {args.export_hf}: could not write it ({err.strerror or err}); the run and its "
                          "checkpoints are intact") from None
    print(f"exported the model to {args.export_hf}")


def checkpoint_bytes(model, parallel: Parallel) -> int:
    """About what one checkpoint takes: the fp32 weights and AdamW's two moments of every rank."""
    size = torch.tensor(sum(local_part(p).numel() * 4 * 3 for p in model.parameters()), dtype=torch.float64)
    if parallel.world > 1:
        dist.all_reduce(size)
    return int(size.item())


def save(folder, step: int, model, optimizer, meta: dict):
    from pith_engine import checkpoint
    try:
        checkpoint.save(folder.checkpoints, step, model, optimizer, meta)
    except checkpoint.CheckpointError as err:
        raise ConfigError(str(err)) from None


def restore(path: Path, model, optimizer, cfg, folder, parallel: Parallel) -> int:
    """Load the checkpoint at path; returns its step. A damaged one stops the run, naming the newest intact."""
    from pith_engine import checkpoint
    try:
        require(checkpoint.read_meta(path).get("config") == config_dict(cfg),
                f"checkpoint '{path}' was trained with another model config; use another --out or drop --resume")
        meta = checkpoint.load(path, model, optimizer)
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"{err}; {on_lead(parallel, lambda: folder.good_one(skip=path))}") from None
    if parallel.rank == 0:
        print(f"resumed from {path} at step {meta['step']} (saved under {meta['layout']})")
    return meta["step"]


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) ask the run to stop: it finishes the step, checkpoints and exits 0 (the ranks
    agree on the step). Another signal more than a second later exits at once, the last checkpoint intact;
    copies within the second (torchrun forwards what the shell already sent its workers) are the same request."""

    def __init__(self):
        self.asked, self.at, self.previous = None, 0.0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def handle(self, signum, frame):
        if self.asked and time.monotonic() - self.at > 1.0:
            print(f"pith-train: {signal.Signals(signum).name} again: stopping now; the last checkpoint is intact",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        if not self.asked:
            self.asked, self.at = signal.Signals(signum).name, time.monotonic()

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def make_progress(start: int, args):
    if args.quiet:
        return lambda loss, tokens_per_s: None
    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=start, desc=f"train {args.model}", unit="step", dynamic_ncols=True)

    def update(loss, tokens_per_s):
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        bar.update()
        if bar.n == args.steps:
            bar.close()
    return update


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.print_config:
            check_args(args)
            print(run_config_text(args), end="")
            return
        train(args)
    except (ConfigError, LayoutError) as err:
        if int(os.environ.get("RANK", "0")) == 0:   # every rank stops alike; one says why
            print(f"pith-train: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
