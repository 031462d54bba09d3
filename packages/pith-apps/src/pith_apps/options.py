"""The app's run settings: the model families, the flags (and the TOML file that can hold them), their
checks, and the Hugging Face config a run's model is built from."""
import argparse
import json
import math
import os
import re
from pathlib import Path

import torch

from pith_apps.config import ConfigError, read_json, require, text_config
from pith_apps.data import DEFAULT_CORPUS
from pith_apps.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from pith_apps.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from pith_apps.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM
from pith_apps.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from pith_engine.moe import BALANCE_MODES
from pith_engine.optim import SCHEDULES
from pith_engine.recompute import MODES as RECOMPUTE_MODES
from pith_ops.fp8 import fp8_missing
from pith_ops.gated_delta import fla_missing

MODELS = {"qwen3": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
          "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
          "gpt_oss": (GptOssConfig, GptOssForCausalLM),
          "qwen3_5": (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM)}
FAMILY_OF = {"qwen3_moe": "qwen3", "deepseek_v2": "deepseek_v2", "gpt_oss": "gpt_oss",   # config model_type -> family
             "qwen3_5_moe_text": "qwen3_5", "qwen3_5_moe": "qwen3_5"}
PRESETS = Path(__file__).parent / "presets"
# copied from beside tokenizer.json on export: the tokenizer's settings, and where the tokenizer is a model folder's
# own (--init's), that folder's generation settings
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OPTIMIZERS = ("adamw", "muon")


DESCRIPTION = ("Train a Qwen3-MoE, DeepSeek-V2, GPT-OSS or Qwen3.5-MoE model on a text dataset with AdamW or Muon, showing "
               "a progress bar, logging to TensorBoard and checkpointing so that --resume continues the run.")


class OneLineParser(argparse.ArgumentParser):
    """A bad flag in one line, as every other error (argparse would print the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pith-train", description=DESCRIPTION)
    add = parser.add_argument
    add("model", nargs="?", help=f"The model family to train: {', '.join(MODELS)}.")
    add("--run-config", metavar="FILE.toml", help="A TOML file whose keys are these flags' names (model, preset, "
        "batch-size, ...); flags given on the command line override it.")
    add("--print-config", action="store_true", help="Print the resolved run as a TOML file for --run-config and exit.")
    add("--preset", default="tiny", help="The size of the model, a config in pith_apps/presets (default: tiny).")
    add("--config", help="A Hugging Face config.json to use instead of the preset.")
    add("--init", metavar="DIR", help="Start from the Hugging Face model folder DIR: its config.json (instead of "
        "--preset and --config), its safetensors weights and, unless --tokenizer is given, its tokenizer.json. "
        "Every process reads only the slices of the files its part of the model holds. DIR may also be a checkpoint of the app (step-N): its model, weights and tokenizer, "
        "a new run (its optimizer state and step are not taken: that is --resume-from).")
    add("--layers", type=int, help="Use N decoder layers, for experiments: the config's first N, or, for a run that "
        "does not start from --init weights, more than the config has, its pattern of layers repeated (enough "
        "layers for --pp with a tiny preset, say).")
    add("--data", default=str(DEFAULT_CORPUS), help="A .txt, .jsonl, .json, .parquet or .arrow file, a folder of "
        "files of one of those kinds, or a Hugging Face hub dataset name (owner/name), to train on (default: the "
        "small corpus bundled with the app).")
    add("--data-cache", default=str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pith" / "tokens"),
        help="The folder where a dataset is stored tokenized, once per dataset and tokenizer, for every run and process "
        "to read (default: $XDG_CACHE_HOME/pith/tokens, else ~/.cache/pith/tokens).")
    add("--data-workers", type=int, default=min(8, os.cpu_count() or 1), help="Processes that tokenize a dataset "
        "(default: the CPU count, at most 8); a dataset of fewer than 2000 documents takes one.")
    add("--text-field", default="text", help="The column of a .jsonl, .json, .parquet or .arrow dataset that holds "
        "the documents; a .txt file's lines are its documents (default: text).")
    add("--export-hf", metavar="DIR", help="At the end of the run, write the trained model to DIR as a Hugging Face "
        "folder: config.json, safetensors weights in the compute dtype and the tokenizer's files. Every process "
        "writes its own part of the weights into the files (DIR must be one folder that every node sees).")
    add("--tokenizer", metavar="PATH", help="A Hugging Face tokenizer.json, or a folder holding one (and its "
        "tokenizer_config.json, which names the end-of-document token); default: UTF-8 bytes, 257 tokens.")
    add("--out", help="The run folder for TensorBoard logs and checkpoints (default: runs/<model>-<preset>, or "
        "runs/<model>-<the --init folder's name>).")
    add("--steps", type=int, default=300, help="The number of optimizer steps of the run (default: 300).")
    add("--batch-size", type=int, default=16, help="Sequences per optimizer step, over all data ranks (default: 16).")
    add("--micro-batch-size", type=int, help="Sequences per forward and backward on each data rank; the gradients "
        "of batch-size / (micro-batch-size x data ranks) micro-batches are accumulated (default: one micro-batch).")
    add("--seq-len", type=int, default=128, help="Tokens per training sequence (default: 128).")
    add("--lr", type=float, default=3e-3, help="The peak learning rate, of AdamW and of Muon alike (default: 0.003).")
    add("--warmup", type=int, default=30, help="Steps of linear learning-rate warmup (default: 30).")
    add("--schedule", default="cosine", help=f"The learning-rate schedule after warmup: {', '.join(SCHEDULES)} "
        "(default: cosine).")
    add("--weight-decay", type=float, default=0.1, help="Decoupled weight decay of the matrices (AdamW's and Muon's); "
        "norms and biases have none (default: 0.1).")
    add("--optimizer", choices=OPTIMIZERS, default="adamw", help="The optimizer. adamw: AdamW for every parameter. muon: "
        "Muon for the decoder layers' hidden matrices (attention and MLA projections, dense and shared-expert MLPs, each routed "
        "expert's own matrices): momentum, then each matrix's update orthogonalized by Newton-Schulz iterations and "
        "scaled by 0.2 x sqrt(max(rows, columns)) to the RMS of an AdamW update, so that one --lr and --weight-decay "
        "serve both; AdamW for the rest (embeddings, LM head, norms, biases, routers and gates, sinks, Qwen3.5's 1-d "
        "and convolution parameters). A sharded matrix is orthogonalized whole, each by one rank of its shard group "
        "(default: adamw).")
    add("--muon-momentum", type=float, default=0.95, help="With --optimizer muon: the momentum of its matrices' "
        "gradients, in [0, 1) (default: 0.95).")
    add("--nesterov", action=argparse.BooleanOptionalAction, default=True, help="With --optimizer muon: orthogonalize "
        "the Nesterov update (the gradient plus momentum x the momentum buffer) rather than the buffer itself "
        "(default: on; --no-nesterov).")
    add("--ns-steps", type=int, default=5, help="With --optimizer muon: Newton-Schulz iterations per matrix and step, "
        "in bf16 on CUDA, fp32 on CPU (default: 5).")
    add("--clip", type=float, default=1.0, help="The global gradient norm is clipped to this (default: 1.0).")
    add("--seed", type=int, default=0, help="Seeds the initial weights and the order of the data (default: 0).")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="The device to train on: cpu, cuda "
        "or cuda:N (default: cuda when torch sees a GPU, else cpu).")
    add("--dtype", choices=DTYPES, help="The compute dtype; weights, gradients and optimizer state are always "
        "float32 (default: bfloat16 on CUDA, float32 on CPU).")
    add("--fp8", nargs="?", const="experts", choices=("experts", "all"), help="Compute in FP8 (e4m3 in 1x128 and "
        "128x128 blocks), each weight quantized once per step (at each use where FSDP2 gathers it: --dp, --ep, --cp): "
        "experts (--fp8 alone): the experts' GEMMs (forward and input gradient); all: also the decoder layers' dense "
        "linears, which at these models' widths ran slower than in bf16 (bench/RESULTS.md). The routers, LM head, "
        "norms and attention stay in the compute dtype, the weights float32. Needs compute capability 9.0+ (H100, "
        "H200); emulated, slowly, on CPU.")
    add("--allow-slow-delta-rule", action="store_true", help="For qwen3_5 on CUDA where fla-core's delta-rule "
        "kernels cannot run (not installed; on Hopper, Triton 3.4 to 3.7.0 without TileLang): run its Gated DeltaNet "
        "layers' delta rule on the torch reference, ~60x slower per layer, instead of stopping with what to install. "
        "Where fla-core's kernels can run they run; on CPU the reference runs without this flag.")
    add("--recompute", choices=RECOMPUTE_MODES, default="none", help="What each decoder layer keeps for its backward "
        "(default: none, everything it reads). selective: the outputs of its GEMMs and attention kernels; the norms, "
        "rotary, SwiGLU activations and the experts' gather run again in the backward (elementwise work). full: "
        "only the layer's input, the tokens its experts receive and the routing; the backward runs each layer's "
        "forward again (a third more GEMM work per step) but never its all-to-alls.")
    add("--compile", action=argparse.BooleanOptionalAction, help="Compile the dense stages with torch.compile "
        "(default: on for CUDA, off on CPU, where it costs minutes).")
    add("--cuda-graph", action=argparse.BooleanOptionalAction, help="After the first 2 steps, capture the training "
        "step as one CUDA graph and replay it: the host launches a step in one call (default: on for one process on "
        "CUDA; CUDA and one process only).")
    add("--balance", help="Expert load balancing: " + ", ".join(BALANCE_MODES) + " (default: the family's own, "
        "sequence for DeepSeek-V2 with seq_aux, else global_batch).")
    add("--capacity-factor", type=float, help="Each expert takes at most F x (slots / experts) of the slots a rank "
        "routes in a micro-batch, first choices first; the rest are dropped, their tokens passing on by the residual "
        "(default: dropless).")
    for dim, meaning in (("dp", "data (FSDP2)"), ("ep", "expert"), ("pp", "pipeline (DualPipeV)"),
                         ("cp", "context (zigzag ring attention)")):
        add(f"--{dim}", type=int, default=1, help=f"The {meaning}-parallel size; the product of the four sizes "
            "must be the number of processes (default: 1).")
    add("--dp-replicate", type=int, default=1, help="Hybrid sharding (HSDP): the --dp ranks as this many replicas of "
        "dp / dp-replicate shards each, the weights sharded within a replica (its ranks consecutive: one node under "
        "torchrun) and the gradients all-reduced across replicas; must divide --dp (default: 1, full sharding).")
    add("--chunk-layers", help="With --pp P: the decoder layers of each of the 2P pipeline chunks, comma-separated "
        "(pipeline rank r holds chunks r and 2P-1-r; default: as even as possible, the spare layers nearest the "
        "turn of the V).")
    add("--overlap", action=argparse.BooleanOptionalAction, help="With --pp and --ep: in each pipeline pair, the "
        "forward and the backward take turns at their all-to-alls, so that one's exchange runs while the other "
        "computes (default: on); --no-overlap runs them one after the other (what the overlap buys).")
    add("--dist-timeout", type=float, default=1800, metavar="SECONDS", help="On several processes: how long a process "
        "waits in any collective or transfer before it stops with a line naming what it waited in, with which ranks, "
        "and writes its recent collectives under <out>/comm-trace (default: 1800, above the longest wait a sound run "
        "makes: a first step's compiles, a checkpoint or export of a large model).")
    add("--save-every", type=int, default=100, help="Checkpoint every N steps and at the end; 0 saves nothing, for "
        "a measurement rather than a run to keep (default: 100).")
    add("--resume", action="store_true", help="Continue from the newest checkpoint in <out>/checkpoints.")
    add("--resume-from", metavar="STEP|PATH", help="Continue from the checkpoint of that step in <out>/checkpoints, "
        "or from a checkpoint folder.")
    add("--overwrite", action="store_true", help="Replace the run that <out> holds; its checkpoints and TensorBoard "
        "logs are deleted.")
    add("--doc-mask", action="store_true", help="Each token attends only to earlier tokens of its own document (documents "
        "end with the tokenizer's end token) and counts its rotary position from its document's start. Attention then "
        "runs with an explicit mask, off the fastest kernels; GPT-OSS materializes its attention scores.")
    add("--eval-every", type=int, default=0, help="Every N steps and at the last, the mean loss and perplexity on "
        "held-out data (the dataset's last --eval-batches global batches, never trained on), logged to TensorBoard "
        "(default: 0, no evaluation).")
    add("--eval-batches", type=int, default=4, help="Global batches held out for --eval-every (default: 4).")
    add("--peak-tflops", type=float, help="The accelerator's bf16 dense peak, TFLOP/s, for the MFU logged to TensorBoard "
        "(each process's share of the run's tokens/s against one accelerator's peak; default: 989 on an H100 or H200, "
        "312 on an A100, 2250 on a B200 by the GPU's name, as their data sheets give it; otherwise no MFU).")
    add("--image-every", type=int, default=50, help="Every N steps and at the last, each MoE layer's expert load to "
        "TensorBoard as a heatmap (layers x experts) and histograms (default: 50).")
    add("--quiet", action="store_true", help="Show no progress bar and no line on tokenizing a dataset.")
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
    """args as a TOML run config (flags left unset are left out, and so are this machine's defaults: the file
    should run as well on another; and --preset where --init or --config gives the model instead)."""
    lines, defaults = [], build_parser()
    for dest, value in vars(args).items():
        machine_default = dest in ("data", "device", "data_cache", "data_workers") and value == defaults.get_default(dest)
        unused = dest == "preset" and (args.init or args.config)
        if value is not None and dest not in ("run_config", "print_config") and not machine_default and not unused:
            text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            lines.append(f"{dest.replace('_', '-')} = {text}")
    return "\n".join(lines) + "\n"


def check_args(args):
    require(args.model is not None, f"no model family given; valid: {', '.join(MODELS)} (as the first argument or "
            "the key 'model' of --run-config)")
    require(args.model in MODELS, f"unknown model '{args.model}'; valid models: {', '.join(MODELS)}")
    require(args.schedule in SCHEDULES, f"unknown --schedule '{args.schedule}'; valid: {', '.join(SCHEDULES)}")
    require(args.balance in (None, *BALANCE_MODES), f"unknown --balance '{args.balance}'; valid: {', '.join(BALANCE_MODES)}")
    require(args.peak_tflops is None or args.peak_tflops > 0, f"--peak-tflops={args.peak_tflops} must be > 0")
    require(args.capacity_factor is None or args.capacity_factor > 0,
            f"--capacity-factor={args.capacity_factor} must be > 0 (leave it out: dropless)")
    require(args.eval_every >= 0, f"--eval-every={args.eval_every} must be >= 0 (0: no evaluation)")
    require(args.dist_timeout > 0, f"--dist-timeout={args.dist_timeout} must be > 0 (seconds)")
    require(args.save_every >= 0, f"--save-every={args.save_every} must be >= 0 (0: no checkpoints)")
    require(not (args.overwrite and (args.resume or args.resume_from)),
            "--overwrite starts the run over; it cannot go with --resume or --resume-from")
    for flag in ("steps", "batch_size", "seq_len", "micro_batch_size", "layers", "data_workers", "eval_batches",
                 "image_every", "ns_steps"):
        value = getattr(args, flag)
        require(value is None or value > 0, f"--{flag.replace('_', '-')}={value} must be a positive integer")
    for flag, positive in (("lr", True), ("clip", True), ("warmup", False), ("weight_decay", False)):
        value = getattr(args, flag)
        require(math.isfinite(value) and (value > 0 if positive else value >= 0), f"--{flag.replace('_', '-')}={value} "
                f"must be a finite number {'> 0' if positive else '>= 0'}")
    require(math.isfinite(args.muon_momentum) and 0 <= args.muon_momentum < 1,
            f"--muon-momentum={args.muon_momentum} must be in [0, 1)")
    require(not (args.resume and args.resume_from), "--resume continues from the newest checkpoint, --resume-from "
            "from the one it names: give one of them")
    require(args.out != "", "--out is empty; give the run's folder, or leave --out out for runs/<model>-<preset>")
    require(args.device in ("cpu", "cuda") or args.device.startswith("cuda:"),
            f"unknown --device '{args.device}'; valid: cpu, cuda, cuda:N")
    require(not args.device.startswith("cuda") or torch.cuda.is_available(),
            f"--device {args.device} asked for, but torch sees no CUDA device; use --device cpu")
    require(args.chunk_layers is None or re.fullmatch(r"\d+(,\d+)*", args.chunk_layers) and args.pp > 1,
            f"--chunk-layers={args.chunk_layers!r} must be comma-separated layer counts (e.g. 2,3,3,2), with --pp > 1 "
            f"(here --pp {args.pp})")
    require(args.overlap is None or args.pp > 1 and args.ep > 1, f"--{'' if args.overlap else 'no-'}overlap is for "
            f"a pipeline with expert parallelism, --pp > 1 and --ep > 1 (here --pp {args.pp} --ep {args.ep})")
    if args.fp8:
        missing = fp8_missing(torch.device(args.device))
        require(missing is None, f"--fp8 cannot run here: {missing}; drop --fp8")
    if args.model == "qwen3_5" and args.device.startswith("cuda") and not args.allow_slow_delta_rule:
        missing = fla_missing()   # found now, before any work, rather than as a warning at the first forward
        require(missing is None, f"qwen3_5 on {args.device} needs fla-core's delta-rule kernels: {missing}; or run the "
                "torch reference, ~60x slower per layer, with --allow-slow-delta-rule")
    processes = args.dp * args.ep * args.pp * args.cp
    require(not args.cuda_graph or (args.device != "cpu" and processes == 1), f"--cuda-graph needs CUDA and one "
            f"process (here --device {args.device}, {processes} process{'es' if processes > 1 else ''}); leave it out or "
            "use --no-cuda-graph")


def check_export(args, run_folder: Path):
    """--export-hf, before the run: a folder the export can replace whole, and neither the run's own folder (or
    one above it, or inside its checkpoints or logs) nor the --init folder the run starts from."""
    from pith_apps.hf_checkpoint import check_replaceable
    export, run = Path(args.export_hf).resolve(), run_folder.resolve()
    inside_run_data = {run / "checkpoints", run / "tb"} & {export, *export.parents}
    require(export != run and export not in run.parents and not inside_run_data,
            f"--export-hf {args.export_hf} would replace the run folder {run_folder} or part of it; give a folder "
            f"of its own (one inside the run folder is fine: {run_folder / 'export'})")
    require(not args.init or export != Path(args.init).resolve(), f"--export-hf {args.export_hf} is the --init folder "
            "the run starts from; give another folder")
    check_replaceable(args.export_hf, "--export-hf")


def preset_names(family: str) -> list[str]:
    """The presets of a family: presets/<family>_<name>.json, not another family's whose name extends this one's
    (qwen3_5_tiny is not qwen3's "5_tiny")."""
    longer = [other for other in MODELS if other != family and other.startswith(f"{family}_")]
    return sorted(p.stem.removeprefix(f"{family}_") for p in PRESETS.glob(f"{family}_*.json")
                  if not p.stem.startswith(tuple(f"{other}_" for other in longer)))


def model_config(args):
    return MODELS[args.model][0].from_dict(hf_config_data(args))


def init_checkpoint(args) -> bool:
    """--init names a checkpoint of the app (a training one, or a weights one that pith-convert wrote)."""
    return bool(args.init) and Path(args.init, "meta.json").is_file()


def hf_config_data(args) -> dict:
    """The Hugging Face config the run's model is built from (preset, --config or --init, cut to --layers)."""
    require(not (args.init and args.config), "--init DIR takes the model's config from DIR; leave out --config")
    if args.init:
        path = Path(args.init, "meta.json" if init_checkpoint(args) else "config.json")
        require(path.is_file(), f"--init '{args.init}' has no config.json; give a Hugging Face model folder "
                "(config.json and *.safetensors) or a checkpoint of the app (step-N, with meta.json)")
    else:
        path = Path(args.config or PRESETS / f"{args.model}_{args.preset}.json")
    valid = preset_names(args.model)
    require(args.config or args.init or path.is_file(), f"unknown --preset '{args.preset}' for {args.model}; valid presets: "
            f"{', '.join(valid)}")
    data = read_json(path)
    if init_checkpoint(args):
        require("hf_config" in data, f"--init '{args.init}': the checkpoint does not record its model's config (saved "
                "by an older Pith); resume its run for one step with --export-hf and --init that folder")
        data = data["hf_config"]
    data = text_config(data)
    model_type = data.get("model_type")
    family = FAMILY_OF.get(model_type, args.model if model_type is None else None)
    require(family is not None, f"config '{path}' has model_type {model_type!r}, which Pith does not train; valid: "
            + ", ".join(f"{kind} ({name})" for kind, name in FAMILY_OF.items()))
    require(family == args.model, f"config '{path}' is a {family} config (model_type {model_type!r}), not {args.model}; "
            f"run: pith-train {family} {f'--init {args.init}' if args.init else f'--config {path}'}")
    if args.layers:
        layers = data.get("num_hidden_layers")
        require(isinstance(layers, int) and (args.layers <= layers or not args.init),
                f"--layers={args.layers} must be at most the --init model's num_hidden_layers={layers} (its weights "
                "hold no more layers)")
        data |= {"num_hidden_layers": args.layers} | (
            {"layer_types": [data["layer_types"][n % layers] for n in range(args.layers)]} if "layer_types" in data else {})
    return data
