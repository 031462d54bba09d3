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
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pith_apps.config import ConfigError, read_json, require
from pith_apps.data import DEFAULT_CORPUS, ByteTokenizer, batch_at, load_token_stream
from pith_apps.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from pith_apps.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from pith_apps.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from pith_engine.compile import compile_stages
from pith_engine.data_parallel import clip_grad_norm, shard_model
from pith_engine.moe import BALANCE_MODES, update_expert_bias
from pith_engine.optim import SCHEDULES, adamw, lr_at
from pith_engine.parallel import LayoutError, Parallel

MODELS = {"qwen3": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
          "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
          "gpt_oss": (GptOssConfig, GptOssForCausalLM)}
PRESETS = Path(__file__).parent / "presets"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pith-train", description=__doc__.split("\n")[0])
    parser.add_argument("model", help=f"model family: {', '.join(MODELS)}")
    parser.add_argument("--preset", default="tiny", help="preset config in pith_apps/presets (default: tiny)")
    parser.add_argument("--config", help="a Hugging Face config.json to use instead of the preset")
    parser.add_argument("--layers", type=int, help="keep only the first N decoder layers of the config (experiments)")
    parser.add_argument("--data", default=str(DEFAULT_CORPUS), help="a .txt/.jsonl file or a folder of them")
    parser.add_argument("--out", help="run folder for TensorBoard logs and the checkpoint (default: runs/<model>-<preset>)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step, over all data ranks")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per forward/backward on each data rank; the "
                        "gradients of batch-size / (micro-batch-size x data ranks) micro-batches are accumulated "
                        "(default: one micro-batch)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--schedule", default="cosine", help=f"learning-rate schedule: {', '.join(SCHEDULES)}")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype; weights, gradients and optimizer state are "
                        "always float32 (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the dense stages (default: on for CUDA, off on CPU, where it costs minutes)")
    parser.add_argument("--balance", help="expert load balancing: " + ", ".join(BALANCE_MODES) + " (default: the "
                        "family's own, sequence for DeepSeek-V2 with seq_aux, else global_batch)")
    for dim, meaning in (("dp", "data (FSDP2)"), ("ep", "expert"), ("pp", "pipeline (validated, not built yet)"),
                         ("cp", "context (validated, not built yet)")):
        parser.add_argument(f"--{dim}", type=int, default=1, help=f"{meaning}-parallel size; the product of the "
                            "four must be the number of processes")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps and at the end; 0: never "
                        "(a measurement, not a run to keep)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in <out>/checkpoints")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def check_args(args):
    require(args.model in MODELS, f"unknown model '{args.model}'; valid models: {', '.join(MODELS)}")
    require(args.schedule in SCHEDULES, f"unknown --schedule '{args.schedule}'; valid: {', '.join(SCHEDULES)}")
    require(args.balance in (None, *BALANCE_MODES), f"unknown --balance '{args.balance}'; valid: {', '.join(BALANCE_MODES)}")
    require(args.save_every >= 0, f"--save-every={args.save_every} must be >= 0 (0: no checkpoints)")
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
    config_cls, _ = MODELS[args.model]
    path = Path(args.config or PRESETS / f"{args.model}_{args.preset}.json")
    valid = sorted(p.stem.removeprefix(f"{args.model}_") for p in PRESETS.glob(f"{args.model}_*.json"))
    require(args.config or path.is_file(), f"unknown --preset '{args.preset}' for {args.model}; valid presets: "
            f"{', '.join(valid)}")
    data = read_json(path)
    if args.layers:
        layers = data.get("num_hidden_layers")
        require(isinstance(layers, int) and args.layers <= layers,
                f"--layers={args.layers} must be at most the config's num_hidden_layers={layers}")
        data |= {"num_hidden_layers": args.layers} | (
            {"layer_types": data["layer_types"][:args.layers]} if "layer_types" in data else {})
    return config_cls.from_dict(data)


def train(args) -> list[float]:
    """Run the training loop; returns the loss of every step run (the same on every rank)."""
    check_args(args)
    cfg = model_config(args)
    tokenizer = ByteTokenizer()
    require(cfg.vocab_size >= tokenizer.vocab_size,
            f"config vocab_size={cfg.vocab_size} is smaller than the byte tokenizer's {tokenizer.vocab_size}")
    out = Path(args.out or f"runs/{args.model}-{args.preset}")
    stream = load_token_stream(args.data, tokenizer)
    joined = join_processes(args)
    try:
        return train_on(args, cfg, *layout(args), stream, out)
    finally:
        if joined:
            dist.destroy_process_group()


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


def train_on(args, cfg, parallel: Parallel, device: torch.device, stream, out: Path) -> list[float]:
    micro_batches = args.batch_size // (micro_batch_size(args, parallel) * parallel.data_ranks)
    from pith_engine import checkpoint  # heavy import (DCP, DTensor: ~0.8 s): only when training
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model = build_model(MODELS[args.model][1], cfg, parallel, device, dtype, args.seed, args.seq_len, args.balance,
                        micro_batches)
    if args.compile if args.compile is not None else device.type == "cuda":
        compile_stages(model)
    optimizer = adamw(model, args.lr, args.weight_decay)
    start = restore(out, model, optimizer, cfg) if args.resume else 0
    lead = parallel.rank == 0
    from torch.utils.tensorboard import SummaryWriter  # heavy import: only when training
    writer = SummaryWriter(out / "tb") if lead else None
    losses, speeds = [], []
    progress = make_progress(start, args) if lead else lambda loss, tokens_per_s: None
    for step in range(start, args.steps):
        tic = time.perf_counter()
        lr = lr_at(step, args.lr, args.warmup, args.steps, args.schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids, labels = batch_at(stream, step, args.seed, args.batch_size, args.seq_len)
        loss_value, grad_norm = train_step(args, parallel, device, model, optimizer, input_ids, labels)
        if not math.isfinite(loss_value):
            raise ConfigError(f"loss became {loss_value} at step {step}; lower --lr (now {args.lr}) or check the data")
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
        if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            checkpoint.save(out / "checkpoints", step + 1, model, optimizer,
                            dict(config=dataclasses.asdict(cfg), layout=dict(dp=parallel.dp, ep=parallel.ep)))
    if lead:
        writer.close()
        if losses:
            memory = (f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
                      if device.type == "cuda" else "")
            print(f"trained steps {start + 1}-{args.steps}: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
                  f"(mean of last 10: {sum(losses[-10:]) / len(losses[-10:]):.3f}), "
                  f"{sorted(speeds)[len(speeds) // 2]:,.0f} tokens/s (median step){memory}; "
                  f"{'checkpoints ' + str(out / 'checkpoints') + ', ' if args.save_every else ''}"
                  f"TensorBoard logs {out / 'tb'}")
    return losses


def train_step(args, parallel: Parallel, device, model, optimizer, input_ids, labels) -> tuple[float, torch.Tensor]:
    """One optimizer step on a global batch, its micro-batches' gradients accumulated; returns the step's loss
    (the same on every rank) and the gradient norm before the clip."""
    tokens = (labels != -100).sum().item()   # of the global batch: each micro-batch's loss is its share of the mean
    loss = torch.zeros((), device=device)
    for ids, targets in micro_batches_of(args, parallel, input_ids, labels):
        micro_loss = model.loss_sum(ids.to(device), targets.to(device)) / tokens
        micro_loss.backward()
        loss += micro_loss.detach()
    grad_norm = clip_grad_norm(model.parameters(), args.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update_expert_bias(model)
    if parallel.world > 1:
        dist.all_reduce(loss, group=parallel.group("dp", "cp", "ep"))
    return loss.item(), grad_norm


def restore(out: Path, model, optimizer, cfg) -> int:
    """The step to continue from: that of the newest checkpoint in <out>/checkpoints (0 when there is none)."""
    from pith_engine import checkpoint
    path = checkpoint.latest(out / "checkpoints")
    if path is None:
        return 0
    require(checkpoint.read_meta(path)["config"] == json.loads(json.dumps(dataclasses.asdict(cfg))),
            f"checkpoint '{path}' was trained with another model config; use another --out or drop --resume")
    meta = checkpoint.load(path, model, optimizer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"resumed from {path} at step {meta['step']} (saved under {meta['layout']})")
    return meta["step"]


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
        train(parse_args(argv))
    except (ConfigError, LayoutError) as err:
        print(f"pith-train: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
