"""The Pith training app: `hatch run apps:train qwen3` (or `python -m pith_apps.train qwen3`).

Reads a model config (a preset or a config.json), builds the model, streams batches from a text
dataset, and trains with AdamW, showing a progress bar, writing TensorBoard scalars to <out>/tb and an
atomic checkpoint to <out>/checkpoint.pt that --resume continues from.
"""
import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from pith_apps.config import ConfigError, read_json, require
from pith_apps.data import DEFAULT_CORPUS, ByteTokenizer, batch_at, load_token_stream
from pith_apps.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from pith_apps.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from pith_apps.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from pith_engine.checkpoint import load, save_atomic
from pith_engine.compile import compile_stages
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
    parser.add_argument("--data", default=str(DEFAULT_CORPUS), help="a .txt/.jsonl file or a folder of them")
    parser.add_argument("--out", help="run folder for TensorBoard logs and the checkpoint (default: runs/<model>-<preset>)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--schedule", default="cosine", help=f"learning-rate schedule: {', '.join(SCHEDULES)}")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="parameter dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the dense stages (default: on for CUDA, off on CPU, where it costs minutes)")
    for dim, meaning in (("pp", "pipeline"), ("dp", "data"), ("cp", "context"), ("ep", "expert")):
        parser.add_argument(f"--{dim}", type=int, default=1, help=f"{meaning}-parallel size (validated; multi-process "
                            "training is not built yet, so the product must be 1)")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps and at the end")
    parser.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def check_args(args):
    require(args.model in MODELS, f"unknown model '{args.model}'; valid models: {', '.join(MODELS)}")
    require(args.schedule in SCHEDULES, f"unknown --schedule '{args.schedule}'; valid: {', '.join(SCHEDULES)}")
    for flag in ("steps", "batch_size", "seq_len", "save_every"):
        require(getattr(args, flag) > 0, f"--{flag.replace('_', '-')}={getattr(args, flag)} must be a positive integer")
    require(args.lr > 0 and args.clip > 0, f"--lr={args.lr} and --clip={args.clip} must be > 0")
    require(args.warmup >= 0 and args.weight_decay >= 0, "--warmup and --weight-decay must be >= 0")
    require(args.device in ("cpu", "cuda") or args.device.startswith("cuda:"),
            f"unknown --device '{args.device}'; valid: cpu, cuda, cuda:N")
    require(not args.device.startswith("cuda") or torch.cuda.is_available(),
            f"--device {args.device} asked for, but torch sees no CUDA device; use --device cpu")


def model_config(args):
    config_cls, _ = MODELS[args.model]
    if args.config:
        return config_cls.from_dict(read_json(args.config))
    path = PRESETS / f"{args.model}_{args.preset}.json"
    valid = sorted(p.stem.removeprefix(f"{args.model}_") for p in PRESETS.glob(f"{args.model}_*.json"))
    require(path.is_file(), f"unknown --preset '{args.preset}' for {args.model}; valid presets: {', '.join(valid)}")
    return config_cls.from_dict(read_json(path))


def train(args) -> list[float]:
    """Run the training loop; returns the loss of every step run."""
    check_args(args)
    cfg = model_config(args)
    tokenizer = ByteTokenizer()
    require(cfg.vocab_size >= tokenizer.vocab_size,
            f"config vocab_size={cfg.vocab_size} is smaller than the byte tokenizer's {tokenizer.vocab_size}")
    out = Path(args.out or f"runs/{args.model}-{args.preset}")
    stream = load_token_stream(args.data, tokenizer)
    device, dtype = torch.device(args.device), DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]

    model = MODELS[args.model][1](cfg)
    parallel = Parallel.build(args.pp, args.dp, args.cp, args.ep)
    parallel.check_model(cfg.num_hidden_layers, next(layer.num_experts for layer in model.model.layers if layer.is_moe),
                         cfg.num_attention_heads, args.seq_len)
    model.init_weights(args.seed)
    model.to(device=device, dtype=dtype)
    if args.compile if args.compile is not None else device.type == "cuda":
        compile_stages(model)
    optimizer = adamw(model, args.lr, args.weight_decay)
    start = 0
    if args.resume and (out / "checkpoint.pt").exists():
        start = restore(out / "checkpoint.pt", model, optimizer, cfg)

    from torch.utils.tensorboard import SummaryWriter  # heavy import: only when training
    writer = SummaryWriter(out / "tb")
    losses = []
    progress = make_progress(start, args)
    for step in range(start, args.steps):
        tic = time.perf_counter()
        lr = lr_at(step, args.lr, args.warmup, args.steps, args.schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids, labels = (t.to(device) for t in batch_at(stream, step, args.seed, args.batch_size, args.seq_len))
        loss = model.loss_sum(input_ids, labels) / labels.numel()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise ConfigError(f"loss became {loss_value} at step {step}; lower --lr (now {args.lr}) or check the data")
        tokens_per_s = labels.numel() / (time.perf_counter() - tic)
        losses.append(loss_value)
        for name, value in (("loss", loss_value), ("lr", lr), ("grad_norm", grad_norm.item()), ("tokens_per_s", tokens_per_s)):
            writer.add_scalar(f"train/{name}", value, step + 1)
        progress(loss_value, tokens_per_s)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(), step=step + 1,
                         config=dataclasses.asdict(cfg))
            save_atomic(state, out / "checkpoint.pt")
    writer.close()
    if losses:
        print(f"trained steps {start + 1}-{args.steps}: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"(mean of last 10: {sum(losses[-10:]) / len(losses[-10:]):.3f}); "
              f"checkpoint {out / 'checkpoint.pt'}, TensorBoard logs {out / 'tb'}")
    return losses


def restore(path: Path, model, optimizer, cfg) -> int:
    state = load(path)
    require(state["config"] == dataclasses.asdict(cfg),
            f"checkpoint '{path}' was trained with another model config; use another --out or drop --resume")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed from {path} at step {state['step']}")
    return state["step"]


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
