"""pith-convert: a checkpoint of the app (saved under any layout) to a Hugging Face model folder, or a Hugging
Face folder to a weights checkpoint that any layout loads.

  python -m pith_apps.convert runs/qwen3-tiny/checkpoints/step-00000300 my-model [--dtype bfloat16]
  python -m pith_apps.convert my-hf-model weights-checkpoint

A checkpoint is exported one decoder layer at a time (the first with the embedding, the last with the final norm
and LM head), so the process holds one layer's fp32 weights, never the whole model's; a Hugging Face folder is read
into the whole model in this process's memory (fp32, on the CPU). A training run needs neither: --init reads the
Hugging Face folder and --export-hf writes one on any layout, each process its own part.
"""
import sys
from pathlib import Path

import torch

from pith_apps.config import ConfigError, read_json, require
from pith_apps.hf_checkpoint import HfFolder, check_replaceable, held_parts, load_hf_weights, pairs
from pith_apps.options import DTYPES, FAMILY_OF, MODELS, TOKENIZER_FILES, OneLineParser
from pith_engine import checkpoint
from pith_engine.parallel import Parallel

WEIGHTS_CHECKPOINT_FILES = ("meta.json", ".metadata", "*.distcp")   # what hf_to_checkpoint writes


def whole_model(family: str, hf_config: dict) -> torch.nn.Module:
    config_cls, model_cls = MODELS[family]
    return model_cls(config_cls.from_dict(hf_config), Parallel())


def tokenizer_files(tokenizer) -> dict:
    """{name in a Hugging Face folder: path} for a tokenizer.json (or a folder holding one) and the files beside
    it; {} for none (the byte tokenizer) or one no longer there."""
    if not tokenizer:
        return {}
    file = Path(tokenizer, "tokenizer.json") if Path(tokenizer).is_dir() else Path(tokenizer)
    if not file.is_file():
        return {}
    return {"tokenizer.json": file} | {name: file.with_name(name) for name in TOKENIZER_FILES
                                       if file.with_name(name).is_file()}


def checkpoint_to_hf(path, out, dtype: torch.dtype | None = None):
    """The checkpoint's weights as a Hugging Face folder (its config.json, safetensors shards and index in dtype,
    default fp32; the run's tokenizer files when they are still where the run read them), one layer at a time."""
    try:
        meta = checkpoint.read_meta(path)
        require("hf_config" in meta, f"checkpoint '{path}' does not record its model's config (saved by an older "
                "Pith); resume it for one step with --export-hf instead")
        require(not (problem := checkpoint.damage(path)), str(problem))
        config_cls, model_cls = MODELS[meta["model"]]
        cfg = config_cls.from_dict(meta["hf_config"])
        with torch.device("meta"):   # the files' plan from the whole model's shapes, nothing allocated
            plan = held_parts(model_cls(cfg, Parallel()))
        folder = HfFolder(out, [(part.name, pairs(part.box)) for part in plan], dtype or torch.float32)
        for layer in range(cfg.num_hidden_layers):
            model = model_cls(cfg, Parallel(), held_layers=[layer])
            checkpoint.load_weights(path, model, verify=False)   # (checked whole above)
            folder.write(held_parts(model))
        folder.finish(meta["hf_config"], tokenizer_files(meta.get("tokenizer")))
    except checkpoint.CheckpointError as err:
        raise ConfigError(str(err)) from None
    except OSError as err:
        raise ConfigError(f"could not write the Hugging Face folder {out} ({err.strerror or err})") from None


def hf_to_checkpoint(folder, out) -> Path:
    """A Hugging Face folder's weights as a weights checkpoint (no optimizer state), with its config in meta.json."""
    config = Path(folder, "config.json")
    require(config.is_file(), f"'{folder}' has no config.json; give a Hugging Face model folder")
    data = read_json(config)
    family = FAMILY_OF.get(data.get("model_type"))
    require(family is not None, f"'{config}' has model_type {data.get('model_type')!r}, which Pith does not train; "
            f"valid: {', '.join(FAMILY_OF)}")
    model = whole_model(family, data)
    model.init_weights(0)   # what the files may lack (declared hf=False) keeps its declared start
    load_hf_weights(model, folder)
    own = Path(folder, "tokenizer.json")
    return checkpoint.save_weights(out, model, dict(model=family, hf_config=data,
                                                    tokenizer=str(own.absolute()) if own.is_file() else None))


def main(argv=None):
    parser = OneLineParser(prog="pith-convert", description="Convert a checkpoint of the app (any layout) "
                                     "to a Hugging Face model folder, or a Hugging Face folder to a weights checkpoint.")
    parser.add_argument("source", help="A checkpoint folder (step-N, with meta.json) or a Hugging Face model folder "
                        "(with config.json).")
    parser.add_argument("out", help="The folder to write: new, empty, or an earlier output of this kind (replaced "
                        "whole).")
    parser.add_argument("--dtype", choices=DTYPES, help="The dtype of the Hugging Face weights (default: float32, "
                        "as the checkpoint holds them).")
    args = parser.parse_args(argv)
    try:
        source = Path(args.source)
        if (source / "meta.json").is_file():
            check_replaceable(args.out, "OUT")
            checkpoint_to_hf(source, args.out, DTYPES.get(args.dtype))
        else:
            require((source / "config.json").is_file(), f"'{source}' is neither a checkpoint (meta.json) nor a "
                    "Hugging Face model folder (config.json)")
            check_replaceable(args.out, "OUT", WEIGHTS_CHECKPOINT_FILES)
            hf_to_checkpoint(source, args.out)
        print(f"wrote {args.out}")
    except ConfigError as err:
        print(f"pith-convert: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
