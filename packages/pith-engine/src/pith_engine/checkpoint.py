"""Checkpoints written atomically: a crash during a save never damages the previous checkpoint."""
import os
from pathlib import Path

import torch


def save_atomic(state: dict, path: str | Path):
    """Write to a temporary file beside `path`, flush it to disk, then rename over `path` in one step."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
