"""Hugging Face checkpoint directories (config.json + safetensors shards + index) in and out, on any layout.

A model says where each Hugging Face tensor lives through `model.hf_views()`: pairs of (name in the file,
view of our parameter in the file's layout), or triples whose third item is the slice of the file
tensor's first dimension the view holds (GPT-OSS stacks all experts in one tensor; a rank holds some). The views are
taken of full-size stand-ins of the parameters (`held_parts`), which turns each into the box of the file tensor that
this process's part of the parameter holds: all of it on one process, FSDP2's row shard of it on several (a pipeline or
expert-parallel rank builds only its layers and experts, so it has no box of the others). Import reads only those boxes
(safetensors' lazy slices), one shard file at a time. Export has every process write its boxes straight into files
whose layout all of them plan alike from the gathered boxes (`HfFolder`), so that no process holds more than its own
part and one box; a part several processes hold (HSDP's replicas) is written once. GPT-OSS expert weights stored as
MXFP4 (`<name>_blocks` + `<name>_scales`) are decoded to the view's dtype. A parameter its module declares absent from
Hugging Face files (pith_apps.models.layers.declare, hf=False) may be missing from a folder (it keeps its start); an
export writes it like any other.
"""
import fnmatch
import itertools
import json
import math
import os
import re
import shutil
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from pith_apps.config import ConfigError, read_json, require, write_problem
from pith_engine.checkpoint import agreed, failure_of
from pith_engine.data_parallel import is_sharded

MAX_SHARD_BYTES = 5 * 10**9
HF_FOLDER_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")   # what save_hf writes
# E2M1 code -> value: codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6; codes 8..15 their negatives
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., out, groups, 16] (two E2M1 codes a byte, low nibble first) and scales uint8
    [..., out, groups] (power-of-two exponents biased by 127) -> [..., out, groups * 32]."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32]
    values = table[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


@dataclass
class Part:
    """This process's part of one file tensor: the box (slices of the file tensor) that `target` (a view of a
    parameter's local shard, in the file's layout) holds. held: the shape of the file tensor as the model sees it
    (dim 0: the experts of `rows` where the view holds rows of a stacked tensor)."""
    name: str
    box: tuple
    target: torch.Tensor
    held: tuple
    rows: slice | None
    param: torch.Tensor
    hf: bool = True   # False: the files may lack it (declared so: pith_apps.models.layers.declare)


def held_parts(model: torch.nn.Module) -> list[Part]:
    """The Part of each Hugging Face tensor that this process holds some of, from model.hf_views() taken of
    full-size stand-ins of the parameters (on the meta device: nothing allocated)."""
    swapped, owner = [], {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                stand_in = torch.empty(param.shape, device="meta")   # a DTensor's shape is the whole tensor's
                swapped.append((module, key, param, stand_in))
                declared = getattr(module, "declared", {}).get(key)
                owner[id(stand_in)] = param, declared is None or declared.hf
    for module, key, _, stand_in in swapped:
        module._parameters[key] = stand_in
    try:
        views = list(model.hf_views())
    finally:
        for module, key, param, _ in swapped:
            module._parameters[key] = param
    parts = []
    for name, view, *rows in views:
        param, hf = owner[id(view if view._base is None else view._base)]
        part = part_of(name, view, rows[0] if rows else None, param)
        if part is not None:
            part.hf = hf
            parts.append(part)
    return parts


def part_of(name: str, view: torch.Tensor, rows: slice | None, param: torch.Tensor) -> Part | None:
    """The Part of file tensor `name`, seen as `view` of a full-size stand-in of param, that this process's part of
    param holds (None: none of it). Each dimension of a view (slices, indexing, transposes of the parameter) walks one
    dimension of the parameter, the one with its stride."""
    strides = torch.empty(param.shape, device="meta").stride()
    first, rest = [], view.storage_offset()   # the parameter's index of the view's first element
    for stride in strides:
        first.append(rest // stride)
        rest %= stride
    dims = [next(j for j, (s, n) in enumerate(zip(strides, param.shape)) if s == stride and n >= size)
            for stride, size in zip(view.stride(), view.shape)]
    if is_sharded(param):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        size, start = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param.to_local()
    else:
        size, start, local = param.shape, [0] * param.dim(), param
    if any(not start[j] <= first[j] < start[j] + size[j] for j in range(param.dim()) if j not in dims):
        return None
    box, shape, at = [], [], list(first)
    for j, n in zip(dims, view.shape):
        lo, hi = max(first[j], start[j]), min(first[j] + n, start[j] + size[j])
        if hi <= lo:
            return None
        box.append(slice(lo - first[j], hi - first[j]))
        shape.append(hi - lo)
        at[j] = lo
    if rows is not None:
        box[0] = slice(box[0].start + rows.start, box[0].stop + rows.start)
    offset = local.storage_offset() + sum((at[j] - start[j]) * local.stride(j) for j in range(param.dim()))
    target = local.as_strided(shape, [local.stride(j) for j in dims], offset)
    return Part(name, tuple(box), target, tuple(view.shape), rows, param)


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


def load_hf_weights(model: torch.nn.Module, model_dir: str | Path) -> list[str]:
    """Fill this process's part of every parameter of `model` (any layout) from the checkpoint in model_dir, one
    shard file at a time, reading only the boxes it holds. Every process of a group calls it; a ConfigError (a
    missing, misshapen or damaged tensor) is raised on all of them. A tensor the files lack whose module declares it
    may be absent (declare(hf=False)) keeps the values it holds (init_weights's): -> their names, of all processes."""
    problem, absent = None, []
    try:
        absent = read_parts(model, Path(model_dir))
    except ConfigError as err:
        problem = str(err)
    problem = agreed(problem)
    if problem:
        raise ConfigError(problem)
    every = [absent]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, absent)
    return sorted(set().union(*every), key=natural)


def absent_line(names: list[str], model_dir) -> str:
    """--init's line for the tensors model_dir lacks (load_hf_weights'), layer numbers as *."""
    patterns = ", ".join(sorted({re.sub(r"\.\d+\.", ".*.", name) for name in names}, key=natural))
    return f"--init: {len(names)} tensors are not in {model_dir}; they start as their modules declare: {patterns}"


def read_parts(model: torch.nn.Module, model_dir: Path):
    files = weight_map(model_dir)
    stored = text_model_names(files)
    files = {name: files[stored[name]] for name in stored}
    by_file, absent = defaultdict(list), []
    for part in held_parts(model):
        if part.name in files:
            by_file[files[part.name]].append(part)
        elif f"{part.name}_blocks" in files and f"{part.name}_scales" in files:
            by_file[files[f"{part.name}_blocks"]].append(part)
        elif not part.hf:
            absent.append(part)
        else:
            raise ConfigError(f"checkpoint '{model_dir}' has no tensor '{part.name}' (expected shape {part.held})")
    written = defaultdict(int)
    with torch.no_grad():
        for file, parts in sorted(by_file.items()):
            with damage_named(model_dir / file), safe_open(model_dir / file, "pt") as shard:
                for part in parts:
                    if part.name in files:
                        tensor = shard.get_slice(stored[part.name])
                        shape = tensor.get_shape()
                        tensor = tensor[part.box]
                    else:
                        shape, tensor = read_mxfp4(model_dir, files, shard, part.name, part.box)
                    if part.rows is not None:
                        shape = [len(range(shape[0])[part.rows]), *shape[1:]]
                    if tuple(shape) != part.held:
                        raise ConfigError(f"tensor '{part.name}' in '{model_dir / file}' has shape {tuple(shape)}; "
                                          f"the config expects {part.held}")
                    part.target.copy_(tensor)
                    if not torch.isfinite(part.target).all():   # (where the model is: on the GPU, fast)
                        raise ConfigError(f"tensor '{part.name}' in '{model_dir / file}' holds non-finite values (NaN or "
                                          "inf); training from it would give a NaN loss")
                    written[id(part.param)] += part.target.numel()
    skipped = {id(part.param) for part in absent}
    for name, param in model.named_parameters():
        if written[id(param)] != local_numel(param) and id(param) not in skipped:
            raise RuntimeError(f"{type(model).__name__}.hf_views() does not fill {name} once whole: a bug of its file")
    return [part.name for part in absent]


def local_numel(param: torch.Tensor) -> int:
    return (param.to_local() if is_sharded(param) else param).numel()


def read_mxfp4(model_dir: Path, files: dict, shard, name: str, box: tuple) -> tuple[list, torch.Tensor]:
    """(shape, box) of an MXFP4 expert weight in the layout of its bf16 name: the file stores [E, out, in] as blocks
    of 32 inputs, the bf16 tensor is [E, in, out]."""
    experts, inputs, outputs = box
    groups = slice(inputs.start // 32, -(-inputs.stop // 32))
    if files[f"{name}_scales"] == files[f"{name}_blocks"]:
        scales = shard.get_slice(f"{name}_scales")[experts, outputs, groups]
    else:
        with safe_open(model_dir / files[f"{name}_scales"], "pt") as other:
            scales = other.get_slice(f"{name}_scales")[experts, outputs, groups]
    blocks = shard.get_slice(f"{name}_blocks")
    count, out, group_count, _ = blocks.get_shape()
    decoded = mxfp4_decode(blocks[experts, outputs, groups], scales).transpose(-2, -1)
    skip = groups.start * 32
    return [count, group_count * 32, out], decoded[:, inputs.start - skip:inputs.stop - skip]


def pairs(box: tuple) -> tuple:
    """A box's slices as (start, stop) pairs, which hash."""
    return tuple((b.start, b.stop) for b in box)


def natural(name: str) -> list:
    """Sort key: layer and expert numbers as numbers."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", name)]


class HfFolder:
    """Safetensors shards being written by every process of a group (one process: alone) into out_dir's temporary
    twin: the tensors' shapes and owners come from every process's claims ((name, box) of what it will write); the
    files' layout is planned from them alike on every process; `write` puts a process's parts at their offsets and
    `finish` seals the folder (index, config, extra files) and renames it into place."""

    def __init__(self, out_dir: str | Path, claims: list, dtype: torch.dtype, max_shard_bytes: int | None = None):
        self.out, self.dtype = Path(out_dir), dtype
        self.tmp = self.out.with_name(self.out.name + ".tmp")
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        every = [claims]
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, claims)
        shapes, self.writer, counts = {}, {}, defaultdict(int)
        for owner, mine in enumerate(every):
            for name, box in mine:
                known = shapes.get(name, [0] * len(box))
                shapes[name] = [max(a, stop) for a, (_, stop) in zip(known, box)]
                if (name, box) not in self.writer:   # a box several processes hold is written by the first
                    self.writer[name, box] = owner
                    counts[name] += math.prod(stop - start for start, stop in box)
        uncovered = [name for name in shapes if counts[name] != math.prod(shapes[name])]
        if uncovered:
            raise RuntimeError(f"the processes' parts of {uncovered[0]} do not cover it once: a bug of the model's "
                               "hf_views()")
        self.rank, self.files, self.at, files, size = rank, [], {}, [[]], 0   # at: name -> (file, offset, shape)
        for name in sorted(shapes, key=natural):
            nbytes = math.prod(shapes[name]) * dtype.itemsize
            if files[-1] and size + nbytes > (max_shard_bytes or MAX_SHARD_BYTES):
                files.append([])
                size = 0
            files[-1].append(name)
            size += nbytes
        for i, names in enumerate(files):
            file, header, offset = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors", {}, 0
            for name in names:
                end = offset + math.prod(shapes[name]) * dtype.itemsize
                header[name] = dict(dtype=SAFETENSORS_DTYPES[dtype], shape=shapes[name], data_offsets=[offset, end])
                offset = end
            text = json.dumps({"__metadata__": {"format": "pt"}} | header).encode()
            text += b" " * (-len(text) % 8)   # the data 8-byte aligned
            start = 8 + len(text)
            self.files.append((file, len(text).to_bytes(8, "little") + text, start + offset))
            self.at.update((name, (file, start + header[name]["data_offsets"][0], shapes[name])) for name in names)
        self.agree(self.create if rank == 0 else lambda: None)

    def agree(self, work):
        problem = agreed(failure_of(work))
        if problem:
            if self.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise OSError(re.sub(r"^\w+: (\[Errno \d+\] )?", "", problem))   # the first rank's, as its own line

    def create(self):
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        for file, header, size in self.files:
            with open(self.tmp / file, "wb") as f:
                f.write(header)
                f.truncate(size)

    def write(self, parts: list[Part]):
        """Every process's parts (call on all, together): each box written once, in place, in dtype."""
        self.agree(lambda: self.put([p for p in parts if self.writer[p.name, pairs(p.box)] == self.rank]))

    def put(self, parts: list[Part]):
        handles = {}
        try:
            for part in parts:
                file, start, shape = self.at[part.name]
                if file not in handles:
                    handles[file] = os.open(self.tmp / file, os.O_WRONLY)
                data = part.target.detach().to("cpu", self.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
                strides = torch.empty(shape, device="meta").stride()
                # contiguous runs: the last dimension the box does not span whole, with everything after it
                cut = max([k for k, (b, n) in enumerate(zip(part.box, shape)) if b.stop - b.start != n], default=0)
                run = math.prod(b.stop - b.start for b in part.box[cut:]) * self.dtype.itemsize
                for i, index in enumerate(itertools.product(*(range(b.start, b.stop) for b in part.box[:cut]))):
                    first = sum(a * s for a, s in zip((*index, part.box[cut].start), strides)) * self.dtype.itemsize
                    os.pwrite(handles[file], data[i * run:(i + 1) * run], start + first)
            for handle in handles.values():
                os.fsync(handle)
        finally:
            for handle in handles.values():
                os.close(handle)

    def finish(self, config: dict, extra_files: dict | None = None):
        """index, config.json (dtype the written one, no quantization_config) and extra_files ({name: source
        path}), then the folder renamed into place: a crash before leaves no half export."""
        def seal():
            total = sum(size - len(header) for _, header, size in self.files)
            weight_map = {name: file for name, (file, _, _) in self.at.items()}
            (self.tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
            written = {k: v for k, v in config.items() if k != "quantization_config"}
            (self.tmp / "config.json").write_text(json.dumps(written | {"dtype": str(self.dtype).removeprefix("torch.")},
                                                             indent=2))
            for name, source in (extra_files or {}).items():
                shutil.copyfile(source, self.tmp / name)
            replace_dir(self.tmp, self.out)
        self.agree(seal if self.rank == 0 else lambda: None)


def save_hf(model: torch.nn.Module, config: dict, out_dir: str | Path, dtype: torch.dtype | None = None,
            max_shard_bytes: int | None = None, extra_files: dict | None = None):
    """Write config.json, safetensors shards of at most max_shard_bytes and their index to out_dir, and copy
    extra_files ({name in out_dir: source path}, e.g. the tokenizer's), from a model of any layout: every process
    of its group calls this and writes its own part (HfFolder). The directory is assembled beside out_dir and
    renamed into place, so a crash leaves no half export."""
    parts = held_parts(model)
    dtype = dtype or next(model.parameters()).dtype
    folder = HfFolder(out_dir, [(p.name, pairs(p.box)) for p in parts], dtype, max_shard_bytes)
    folder.write(parts)
    folder.finish(config, extra_files)
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
