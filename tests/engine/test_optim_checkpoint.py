import math

import pytest
import torch

import pith_engine.checkpoint as checkpoint
from pith_engine.optim import adamw, lr_at


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    lrs = [lr_at(s, 1.0, warmup=10, total=110, schedule="cosine", min_ratio=0.1) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(500, 2.0, warmup=10, total=110, schedule="constant") == 2.0


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = adamw(model, lr=1e-3, weight_decay=0.1).param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic({"step": 1, "w": torch.ones(3)}, path)

    def dies_halfway(obj, f):
        f.write(b"partial bytes")
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint.torch, "save", dies_halfway)
    with pytest.raises(OSError):
        checkpoint.save_atomic({"step": 2, "w": torch.zeros(3)}, path)
    state = checkpoint.load(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
