"""Hugging Face checkpoint directories (config.json + safetensors shards + index) in and out.

A model says where each Hugging Face tensor lives through `model.hf_views()`: pairs of (name in the file,
view of our parameter in the file's layout), or triples whose third item is the slice of the file
tensor's first dimension the view holds (GPT-OSS stacks all experts in one tensor; a rank holds some). Import copies each tensor into its view, reading one shard
at a time and only the tensors this model instance holds (a pipeline or expert-parallel rank builds only
its layers and experts, so it reads only those). Export writes the views back out, one shard at a time.
GPT-OSS expert weights stored as MXFP4 (`<name>_blocks` + `<name>_scales`) are decoded to the view's dtype.
"""
import fnmatch
import json
import os
import shutil
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pith_apps.config import ConfigError, read_json, require, write_problem

MAX_SHARD_BYTES = 5 * 10**9
HF_FOLDER_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")   # what save_hf writes
# E2M1 code -> value: codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 their negatives
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., out, groups, 16] (two E2M1 codes a byte, low nibble first) and scales uint8
    [..., out, groups] (power-of-two exponents biased by 127) -> [..., out, groups * 32]."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32]
    values = table[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or from a single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return read_json(index)["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"'{model_dir}' has neither model.safetensors nor model.safetensors.index.json")
    with damage_named(single):
        with safe_open(single, "pt") as f:
            return {name: single.name for name in f.keys()}


@contextmanager
def damage_named(file: Path):
    """A safetensors file that cannot be read (truncated, not safetensors, without a tensor its index places in it)
    as one line naming it."""
    try:
        yield
    except (SafetensorError, OSError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"'{file}' could not be read ({why}); its folder's weights are damaged or do not match "
                          "their index") from None


def text_model_names(files: dict[str, str]) -> dict[str, str]:
    """Our tensor name -> the name in the files: the same, except in a multimodal checkpoint (Qwen3.5-MoE's released
    ones), which keeps its language model under model.language_model. (model.visual. and mtp. are not read)."""
    prefix = "model.language_model."
    return {("model." + name.removeprefix(prefix) if name.startswith(prefix) else name): name for name in files}


def load_hf_weights(model: torch.nn.Module, model_dir: str | Path):
    """Fill every parameter of `model` from the checkpoint in model_dir, one shard file at a time."""
    model_dir = Path(model_dir)
    files = weight_map(model_dir)
    stored = text_model_names(files)
    files = {name: files[stored[name]] for name in stored}
    views, rows = {}, {}
    for name, view, *part in model.hf_views():
        views[name], rows[name] = view, part[0] if part else slice(None)
    by_file = defaultdict(list)
    for name, view in views.items():
        if name in files:
            by_file[files[name]].append(name)
        elif f"{name}_blocks" in files and f"{name}_scales" in files:
            by_file[files[f"{name}_blocks"]].append(name)
        else:
            raise ConfigError(f"checkpoint '{model_dir}' has no tensor '{name}' (expected shape {tuple(view.shape)})")
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with damage_named(model_dir / file), safe_open(model_dir / file, "pt") as shard:
                for name in names:
                    if name in files:
                        tensor = shard.get_slice(stored[name])[rows[name]]
                    else:
                        tensor = read_mxfp4(model_dir, files, shard, name, rows[name])
                    if tuple(tensor.shape) != tuple(views[name].shape):
                        raise ConfigError(f"tensor '{name}' in '{model_dir / file}' has shape {tuple(tensor.shape)}; "
                                          f"the config expects {tuple(views[name].shape)}")
                    views[name].copy_(tensor)
                    if not torch.isfinite(views[name]).all():   # (where the model is: on the GPU, fast)
                        raise ConfigError(f"tensor '{name}' in '{model_dir / file}' holds non-finite values (NaN or "
                                          "inf); training from it would give a NaN loss")


def read_mxfp4(model_dir: Path, files: dict, shard, name: str, experts: slice) -> torch.Tensor:
    """Decode experts `experts` of an MXFP4 expert weight to the layout of its bf16 name: the file stores
    [E, out, in] as blocks, the bf16 tensor is [E, in, out]."""
    scales_file = files[f"{name}_scales"]
    if scales_file == files[f"{name}_blocks"]:
        scales = shard.get_slice(f"{name}_scales")[experts]
    else:
        with safe_open(model_dir / scales_file, "pt") as other:
            scales = other.get_slice(f"{name}_scales")[experts]
    return mxfp4_decode(shard.get_slice(f"{name}_blocks")[experts], scales).transpose(-2, -1)


def save_hf(model: torch.nn.Module, config: dict, out_dir: str | Path, dtype: torch.dtype | None = None,
            max_shard_bytes: int = MAX_SHARD_BYTES, extra_files: dict | None = None):
    """Write config.json, safetensors shards of at most max_shard_bytes and their index to out_dir, and copy
    extra_files ({name in out_dir: source path}, e.g. the tokenizer's). The directory is assembled beside
    out_dir and renamed into place, so a crash leaves no half export."""
    out_dir = Path(out_dir)
    views = []
    for name, view, *part in model.hf_views():
        if part and (part[0].start, part[0].stop) != (0, view.shape[0]):
            raise ConfigError(f"'{name}': this process holds experts {part[0].start}..{part[0].stop - 1} only; "
                              "export from a model that holds every expert (one process, --ep 1)")
        views.append((name, view))
    shards, size = [[]], 0
    for name, view in views:
        nbytes = view.numel() * (dtype or view.dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, view))
        size += nbytes
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: view.detach().to("cpu", dtype or view.dtype).contiguous() for name, view in shard}
        save_file(tensors, tmp / file, metadata={"format": "pt"})
        index.update({name: file for name in tensors})
        total += sum(t.numel() * t.itemsize for t in tensors.values())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    written_dtype = str(dtype or views[0][1].dtype).removeprefix("torch.")
    config = {k: v for k, v in config.items() if k != "quantization_config"} | {"dtype": written_dtype}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name, source in (extra_files or {}).items():
        shutil.copyfile(source, tmp / name)
    replace_dir(tmp, out_dir)


def replace_dir(new: Path, target: Path):
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def check_replaceable(out: str | Path, flag: str, kinds: tuple[str, ...] = HF_FOLDER_FILES):
    """An output folder that a write replaces whole (save_hf, a weights checkpoint) must be new, empty, or hold only
    the files such an output has (`kinds`, name patterns): anything else in it would be lost. And it must be
    writable, checked before the work that ends in it."""
    out = Path(out)
    require(not out.exists() or out.is_dir(), f"{flag} {out} is a file; give a new folder")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if not any(fnmatch.fnmatch(p.name, kind) for kind in kinds))
        if others:
            raise ConfigError(f"{flag} {out} holds {others[0]!r}{f' and {len(others) - 1} more' if others[1:] else ''}"
                              ", which the folder, replaced whole, would lose; give a new or empty folder")
    above = next(folder for folder in out.absolute().parents if folder.exists())
    require(above.is_dir(), f"{flag} {out} cannot be written ({above} is a file); give another folder")
    problem = write_problem(out.parent)
    require(problem is None, f"{flag} {out} cannot be written ({problem}); give another folder")
