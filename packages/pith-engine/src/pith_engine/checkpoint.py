"""Training checkpoints: torch.distributed.checkpoint (DCP) in layout-free names, resumable under any layout,
written atomically.

Entries carry the model's own parameter names, which outside the experts are the Hugging Face checkpoint's
(model.layers.N.self_attn.q_proj.weight, ...). Expert stacks are split into one entry per expert under its
global id with our stacked parameter's leaf name, model.layers.N.mlp.experts.E.gate_up_proj / down_proj
(GPT-OSS also .._bias): neither the Hugging Face files' names nor transformers' (for those, load into a model
and export with pith_apps.hf_checkpoint.save_hf). No name has a parallel prefix. Every tensor is fp32 (master
weights, AdamW state). Each rank hands DCP the tensors it holds, FSDP shards as DTensors, so DCP writes every
element once and a later load under another layout reads the pieces it needs. The AdamW moments follow their
parameters (optimizer.<name>.exp_avg / exp_avg_sq); the step counter, the aux-free expert biases and the RNG
state ride along, and meta.json holds what is not a tensor.

A save writes step-N.tmp/, then rank 0 renames it to step-N/ and points the `latest` file at it (each
rename one atomic step): a crash midway leaves the previous checkpoint untouched and `latest` naming it.
"""
import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

KEEP = 2   # newest checkpoints kept; older ones are deleted after a successful save


def expert_entry(stack: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e of a stacked [experts, ...] tensor, aliasing it; FSDP shards the stacks by rows (dim 1), so
    the slice of a shard is a row shard of that expert's matrix."""
    if not isinstance(stack, DTensor):
        return stack[e]
    shape = stack.shape[1:]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(stack.to_local()[e], stack.device_mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=stride)


def canonical_entries(model: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """(canonical name, tensor) for tensors keyed by parameter name, expert stacks split per expert."""
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            yield name, tensor
            continue
        prefix, leaf = name.rsplit(".", 1)
        experts = model.get_submodule(prefix)
        for e in range(experts.local_experts):
            yield f"{prefix}.{experts.first_expert + e}.{leaf}", expert_entry(tensor, e)


def init_optimizer_state(optimizer: torch.optim.Optimizer):
    """AdamW's state before its first step, so that a load has tensors to fill."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                step_device = param.device if group.get("fused") else "cpu"
                optimizer.state[param] = dict(step=torch.zeros((), device=step_device),
                                              exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))


def training_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Everything a resume needs, as DCP entries aliasing the live tensors (a load fills them in place)."""
    init_optimizer_state(optimizer)
    params = dict(model.named_parameters())
    state = dict(canonical_entries(model, params))
    state.update((name, buffer) for name, buffer in model.named_buffers() if name.endswith("expert_bias"))
    for moment in ("exp_avg", "exp_avg_sq"):
        moments = {name: optimizer.state[param][moment] for name, param in params.items()}
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


def barrier():
    if dist.is_initialized():
        dist.barrier()


def save(directory: str | Path, step: int, model, optimizer, meta: dict) -> Path:
    """Write step-<step>/ under directory (all ranks call this); meta (JSON) goes into meta.json."""
    directory = Path(directory)
    final, tmp = directory / f"step-{step:08d}", directory / f"step-{step:08d}.tmp"
    if is_writer():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    with single_process_is_meant():
        dcp.save(training_state(model, optimizer), checkpoint_id=tmp)
    if is_writer():
        write_atomic(tmp / "meta.json", json.dumps(meta | {"step": step}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_atomic(directory / "latest", final.name)
        for old in sorted(directory.glob("step-????????"))[:-KEEP]:
            shutil.rmtree(old)
    barrier()
    return final


def write_atomic(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under directory, or None."""
    pointer = Path(directory) / "latest"
    return Path(directory) / pointer.read_text().strip() if pointer.is_file() else None


def read_meta(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / "meta.json").read_text())


def load(checkpoint: str | Path, model, optimizer) -> dict:
    """Fill model, optimizer and RNG from a checkpoint saved under any layout; returns its meta."""
    state = training_state(model, optimizer)
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    if "rng.cuda" not in saved:   # saved without a GPU
        state.pop("rng.cuda", None)
    missing = [name for name in state if name not in saved]
    if missing:
        raise ValueError(f"checkpoint '{checkpoint}' lacks {len(missing)} of this model's entries, e.g. "
                         f"{missing[:3]}; it was saved from another model")
    with single_process_is_meant():
        dcp.load(state, checkpoint_id=Path(checkpoint))
    for param_state in optimizer.state.values():
        param_state["step"].copy_(state["optimizer.step"])
    torch.set_rng_state(state["rng.cpu"])
    if "rng.cuda" in state:
        torch.cuda.set_rng_state(state["rng.cuda"])
    return read_meta(checkpoint)
