"""Training checkpoints: torch.distributed.checkpoint (DCP) in layout-free names, resumable under any layout,
written atomically.

Entries carry the model's own parameter names, which outside the experts are the Hugging Face checkpoint's
(model.layers.N.self_attn.q_proj.weight, ...). Expert stacks are split into one entry per expert under its
global id with our stacked parameter's leaf name, model.layers.N.mlp.experts.E.gate_up_proj / down_proj
(GPT-OSS also .._bias): neither the Hugging Face files' names nor transformers' (for those, load into a model
and export with pith_apps.hf_checkpoint.save_hf). No name has a parallel prefix. Every tensor is fp32 (master
weights, optimizer state). Each rank hands DCP the tensors it holds, FSDP shards as DTensors, so DCP writes every
element once and a later load under another layout reads the pieces it needs. The optimizer's state tensors follow
their parameters (AdamW's optimizer.<name>.exp_avg / exp_avg_sq, Muon's optimizer.<name>.momentum_buffer); the step
counter, the aux-free expert biases and the global RNG state (one, as DCP keeps one copy of a plain tensor: every
rank gets rank 0's back; the app draws from explicit generators) ride along, and meta.json holds what is not a
tensor.

A save writes step-N.tmp/, then each rank sums the size and CRC-32 of the files it wrote, rank 0 checks that it sees
them all (--out must be one folder for every node) and records them in meta.json (and meta.json's own), renames
the folder to step-N/ and points the `latest` file at it (each rename one atomic step): a crash midway leaves the
previous checkpoint untouched and `latest` naming it. A load first checks every file against meta.json, every
file DCP's .metadata reads from against it too, and meta.json against its checksum and its step against the
folder's name, so a truncated, missing or altered file stops it with CheckpointError instead of loading changed
weights. A meta.json without its checksum is read only where it is of the format written before checksums were
(OLDER_FORMAT's keys alone).
Pruning keeps the KEEP most recently saved checkpoints of the saving run's lineage (meta "run") and, while one of
those was saved after the run's loss had risen (meta "rose_at", the app's judgement), the newest one from before
the rise; it never touches a checkpoint of another run.
"""
import contextlib
import json
import os
import re
import shutil
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from pith_engine.contract import MoeModel, expert_stacks

KEEP = 2   # most recently saved checkpoints of a run kept; older ones are deleted after a successful save
STEP_FOLDER = re.compile(r"step-\d{8}")
# what a meta.json written before it carried its own checksum (Pith before 2026-12-05) could hold: one without the
# checksum but with any other key was edited
OLDER_FORMAT = {"run", "config", "layout", "model", "hf_config", "tokenizer", "batches", "step", "saved_at", "files"}


class CheckpointError(ValueError):
    """A checkpoint that could not be written, or cannot be read back as it was written; the message says which
    and why."""


def expert_entry(stack: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e of a stacked [experts, ...] tensor, aliasing it; FSDP shards the stacks by rows (dim 1), so
    the slice of a shard is a row shard of that expert's matrix (and, under HSDP, replicated across replicas as
    the stack is)."""
    if not isinstance(stack, DTensor):
        return stack[e]
    shape = stack.shape[1:]
    stride = torch.empty(shape, device="meta").stride()
    placements = [Shard(0) if isinstance(p, Shard) else p for p in stack.placements]
    return DTensor.from_local(stack.to_local()[e], stack.device_mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def canonical_entries(model: MoeModel, tensors: dict[str, torch.Tensor]):
    """(canonical name, tensor) for tensors keyed by parameter name, expert stacks split per expert."""
    stacks = expert_stacks(model)
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        experts = stacks.get(prefix)
        if experts is None:
            yield name, tensor
            continue
        for e in range(experts.local_experts):
            yield f"{prefix}.{experts.first_expert + e}.{leaf}", expert_entry(tensor, e)


def init_optimizer_state(optimizer: torch.optim.Optimizer):
    """The optimizer's state before its first step, so that a load has tensors to fill: as pith's optimizers make it
    (state_of: AdamW's or Muon's), else AdamW's."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if hasattr(optimizer, "state_of"):
                optimizer.state_of(param)
            elif not optimizer.state[param]:
                step_device = param.device if group.get("fused") else "cpu"
                optimizer.state[param] = dict(step=torch.zeros((), device=step_device),
                                              exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))


def weights_state(model: MoeModel) -> dict[str, torch.Tensor]:
    """The model's entries: its parameters (experts one by one) and aux-free expert biases, aliasing them."""
    state = dict(canonical_entries(model, dict(model.named_parameters())))
    state.update((name, buffer) for name, buffer in model.named_buffers() if name.endswith("expert_bias"))
    return state


def training_state(model: MoeModel, optimizer) -> dict[str, torch.Tensor]:
    """Everything a resume needs, as DCP entries aliasing the live tensors (a load fills them in place)."""
    init_optimizer_state(optimizer)
    params = dict(model.named_parameters())
    state = weights_state(model)
    for moment in dict.fromkeys(key for param in params.values() for key in optimizer.state[param] if key != "step"):
        moments = {name: optimizer.state[param][moment] for name, param in params.items()
                   if moment in optimizer.state[param]}
        state.update((f"optimizer.{name}.{moment}", t) for name, t in canonical_entries(model, moments))
    state["optimizer.step"] = optimizer.state[next(iter(params.values()))]["step"]
    state["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["rng.cuda"] = torch.cuda.get_rng_state()
    return state


@contextlib.contextmanager
def single_process_is_meant():
    """DCP warns at every save and load without a process group that it assumes one process: we do mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save(directory: str | Path, step: int, model: MoeModel, optimizer, meta: dict, size: int | None = None) -> Path:
    """Write step-<step>/ under directory (all ranks call this); meta (JSON, with "run": the lineage to prune
    within) goes into meta.json with the step, the time and the files' checksums. A failure on any rank, rank 0's
    own writes included, raises CheckpointError on every rank, none left waiting for the others; size (the
    caller's estimate of a checkpoint's bytes) lets it tell a full disk from other failures."""
    directory = Path(directory)
    final, tmp = directory / f"step-{step:08d}", directory / f"step-{step:08d}.tmp"

    def start():
        for stale in directory.glob("step-????????.tmp"):   # this one, or one a killed save left
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)

    def write():
        with single_process_is_meant():
            dcp.save(training_state(model, optimizer), checkpoint_id=tmp)   # returns once every rank has written
        files = checksums_of_all(tmp)
        if is_writer():
            write_atomic(tmp / "meta.json", sealed(meta | dict(step=step, saved_at=time.time(), files=files)))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_atomic(directory / "latest", final.name)
    problem = agreed(failure_of(start) if is_writer() else None)
    problem = problem or agreed(failure_of(write))
    if problem:   # what was written of it, by every rank (on a folder not shared, each its own): space free again
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(directory).free if directory.is_dir() else 0
        if "No space left" in problem or "unexpected pos" in problem or size and free < size:   # (torch's zip writer)
            problem = f"the disk is full: {directory} has {size_text(free)} free" + (
                f", a checkpoint takes about {size_text(size)}" if size else "")
        else:
            problem += f"; {size_text(free)} free there"
        raise CheckpointError(f"could not write checkpoint '{final}' ({problem}); the last good checkpoint is "
                              f"{latest_name(directory)}")
    if is_writer():
        try:
            prune(directory, meta.get("run"))
        except OSError as err:   # saved all the same: the run goes on, with more on disk than it keeps
            warnings.warn(f"checkpoint '{final}' was saved, but an older one could not be deleted ({first_line(err)})")
    return final


def size_text(size: float) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def failure_of(work) -> str | None:
    """work()'s failure to write, as one line; None when it succeeded."""
    try:
        work()
    except (OSError, RuntimeError, dcp.api.CheckpointException) as err:
        return first_line(err)
    return None


def agreed(problem: str | None) -> str | None:
    """The first rank's problem on every rank (None where none had one), so that all go on or stop alike."""
    if not dist.is_initialized():
        return problem
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def first_line(err: BaseException) -> str:
    """What went wrong, in one line: for DCP's gathered failures, the first rank's own exception."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)   # releases the GIL: files are summed in parallel threads
    return crc


def checksums(files: list[Path]) -> dict[str, list[int]]:
    """{file name: [bytes, CRC-32]} of the files."""
    with ThreadPoolExecutor(8) as pool:
        crcs = list(pool.map(crc32_of, files))
    return {p.name: [p.stat().st_size, crc] for p, crc in zip(files, crcs)}


def checksums_of_all(folder: Path) -> dict[str, list[int]]:
    """checksums() of every file DCP wrote into folder, for rank 0 (the others get {}): each rank sums its own
    (DCP names them __<rank>_<n>.distcp; rank 0 also the rest, .metadata), so the reading is split like the
    writing. Raises FileNotFoundError where rank 0 does not see another rank's file as that rank wrote it: --out
    is not one folder for every node, and a checkpoint sealed from rank 0's view alone would not load."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    own = sorted(p for p in folder.iterdir() if p.is_file() and p.name != "meta.json" and (
        p.name.startswith(f"__{rank}_") or rank == 0 and not re.match(r"__\d+_", p.name)))
    try:
        mine = checksums(own)
    except OSError as err:   # sent to rank 0 like the sums: no rank stops before the gather the others wait in
        mine = (err.errno, err.strerror)
    parts = [mine]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    if rank != 0:
        return {}
    for other, files in enumerate(parts):
        if isinstance(files, tuple):
            raise OSError(*files)
        for name, (size, _) in files.items():
            if not (folder / name).is_file() or (folder / name).stat().st_size != size:
                raise FileNotFoundError(f"rank {other}'s file {name} is not in {folder} as rank 0 sees it: --out "
                                        "must be one folder that every node sees (a shared file system)")
    return {name: value for files in parts for name, value in sorted(files.items())}


def saved_checkpoints(directory: str | Path) -> list[tuple[Path, dict]]:
    """(checkpoint, its meta) under directory whose meta.json reads, the most recently saved last."""
    found = []
    for path in Path(directory).glob("step-????????"):
        with contextlib.suppress(CheckpointError):
            found.append((path, read_meta(path)))
    return sorted(found, key=lambda item: item[1].get("saved_at", 0))


def prune(directory: Path, run):
    """Delete the checkpoints of lineage `run` beyond the KEEP most recently saved, except, for a kept one whose meta
    records rose_at (the step at which the run's loss rose, by the app's judgement), the newest one from before
    step rose_at - 1 (whose weights gave the loss before the rise); one unreadable or of another run is never
    deleted."""
    mine = [(path, meta) for path, meta in saved_checkpoints(directory) if meta.get("run") == run]
    keep = {path for path, _ in mine[-KEEP:]}
    for rose in {meta["rose_at"] for _, meta in mine[-KEEP:] if meta.get("rose_at")}:
        keep.update([path for path, meta in mine if meta.get("step", rose) < rose - 1 and not meta.get("rose_at")][-1:])
    for path, _ in mine:
        if path not in keep:
            shutil.rmtree(path)


def write_atomic(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest(directory: str | Path) -> Path | None:
    """The checkpoint the `latest` file of directory names (None: no file); CheckpointError if it names none."""
    pointer = Path(directory) / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_bytes().decode(errors="replace").strip()
    if not STEP_FOLDER.fullmatch(name):
        raise CheckpointError(f"'{pointer}' names {name[:40]!r}, not a checkpoint folder")
    return Path(directory) / name


def latest_name(directory: Path) -> str:
    with contextlib.suppress(CheckpointError):
        path = latest(directory)
        return f"'{path}'" if path else "none"
    return "unknown ('latest' is damaged)"


def sealed(meta: dict) -> str:
    """meta.json's text: meta with the CRC-32 of its own content (meta_crc), which read_meta checks, so that the
    description of a checkpoint is verified as its files are."""
    return json.dumps(meta | dict(meta_crc=zlib.crc32(json.dumps(meta, sort_keys=True).encode())), indent=1)


def read_meta(checkpoint: str | Path) -> dict:
    """A checkpoint's meta.json, checked: its own checksum (checkpoints written before it was recorded have none)
    and, in a step-N folder, its step against N."""
    try:
        meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint '{checkpoint}' is incomplete or damaged: its meta.json cannot be read "
                              f"({first_line(err)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"checkpoint '{checkpoint}' is damaged: its meta.json lists no files")
    crc = meta.pop("meta_crc", None)
    if crc is not None and crc != zlib.crc32(json.dumps(meta, sort_keys=True).encode()):
        raise CheckpointError(f"checkpoint '{checkpoint}' is damaged: its meta.json was changed after it was written "
                              "(it does not match its checksum)")
    newer = sorted(set(meta) - OLDER_FORMAT)
    if crc is None and newer:
        raise CheckpointError(f"checkpoint '{checkpoint}' is damaged: its meta.json has no checksum, yet holds "
                              f"'{newer[0]}', which only checksummed ones hold: it was edited")
    name = Path(checkpoint).name
    if STEP_FOLDER.fullmatch(name) and "step" in meta and meta["step"] != int(name.removeprefix("step-")):
        raise CheckpointError(f"checkpoint '{checkpoint}' is damaged: its meta.json names step {meta.get('step')}, "
                              "not its folder's")
    return meta


def damage(checkpoint: str | Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint is not as it was written (None: it is). share = (i, n): check only every n-th file from
    the i-th, so that n ranks split the reading; the first share also checks that every file DCP's .metadata reads
    from is listed, or (meta.json of the older format) there with the bytes it reads."""
    try:
        files = read_meta(checkpoint)["files"]
    except CheckpointError as err:
        return str(err)
    for name, (size, crc) in sorted(files.items())[share[0]::share[1]]:
        path = Path(checkpoint) / name
        if not path.is_file():
            return f"checkpoint '{checkpoint}' is damaged: its file {name} is missing"
        if path.stat().st_size != size:
            return f"checkpoint '{checkpoint}' is damaged: its file {name} has {path.stat().st_size} bytes, not {size}"
        if crc32_of(path) != crc:
            return f"checkpoint '{checkpoint}' is damaged: its file {name} does not match its checksum"
    if share[0] != 0:
        return None
    try:
        storage = dcp.FileSystemReader(checkpoint).read_metadata().storage_data
    except Exception as err:   # a missing or truncated .metadata: unpickling raises what it meets (EOFError, ...)
        return f"checkpoint '{checkpoint}' is damaged: its .metadata cannot be read ({first_line(err)})"
    ends = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = Path(checkpoint) / name
        if name not in files and (not path.is_file() or path.stat().st_size < end):
            held = f"has {path.stat().st_size} bytes, fewer than the {end} it" if path.is_file() else "is missing, which"
            return f"checkpoint '{checkpoint}' is damaged: its file {name} {held} .metadata reads"
    return None


def newest_good(directory: str | Path, skip: Path | None = None) -> Path | None:
    """The most recently saved checkpoint under directory that is as it was written (every file checked)."""
    return next((path for path, _ in reversed(saved_checkpoints(directory)) if path != skip and damage(path) is None), None)


def load(checkpoint: str | Path, model: MoeModel, optimizer) -> dict:
    """Fill model, optimizer and RNG from a checkpoint saved under any layout, after checking its files (the
    ranks split them); returns its meta. CheckpointError when it is damaged or of another model."""
    state = training_state(model, optimizer)
    read_checked(checkpoint, state)
    meta = read_meta(checkpoint)
    for param_state in optimizer.state.values():
        param_state["step"].copy_(state["optimizer.step"])
    torch.set_rng_state(state["rng.cpu"])
    if "rng.cuda" in state:
        torch.cuda.set_rng_state(state["rng.cuda"])
    return meta


def load_weights(checkpoint: str | Path, model: MoeModel, verify: bool = True) -> dict:
    """Fill only the model (weights, expert biases) from a training checkpoint or one save_weights wrote, under
    any layout; returns its meta. verify False: without checking its files first (a caller that did)."""
    read_checked(checkpoint, weights_state(model), verify)
    return read_meta(checkpoint)


def read_checked(checkpoint: str | Path, state: dict, verify: bool = True):
    """DCP-load the entries of state from checkpoint after checking its files (the ranks split them)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = [damage(checkpoint, (rank, world)) if verify else None]
    if world > 1:
        mine, found = found[0], [None] * world
        dist.all_gather_object(found, mine)
    if any(found):
        raise CheckpointError(next(f for f in found if f))
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    if "rng.cuda" not in saved:   # saved without a GPU
        state.pop("rng.cuda", None)
    missing = [name for name in state if name not in saved]
    if missing:
        raise CheckpointError(f"checkpoint '{checkpoint}' lacks {len(missing)} of this model's entries, e.g. "
                              f"{missing[:3]}; it was saved from another model")
    with single_process_is_meant():
        dcp.load(state, checkpoint_id=Path(checkpoint))


def save_weights(folder: str | Path, model: MoeModel, meta: dict) -> Path:
    """A one-process model's weights (no optimizer state) as a checkpoint folder that load_weights reads under any
    layout, written by this process alone (others of its group may wait) and renamed into place whole."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with single_process_is_meant():
        dcp.save(weights_state(model), checkpoint_id=tmp, no_dist=True)
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    write_atomic(tmp / "meta.json", sealed(meta | dict(saved_at=time.time(), files=checksums(files))))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder
