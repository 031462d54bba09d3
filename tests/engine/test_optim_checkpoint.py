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


def test_wsd_schedule_holds_then_decays_linearly_over_the_last_fifth():
    lrs = [lr_at(s, 1.0, warmup=10, total=100, schedule="wsd", min_ratio=0.1) for s in range(101)]
    assert lrs[9] == pytest.approx(1.0) and lrs[80] == pytest.approx(1.0)
    assert lrs[90] == pytest.approx(1.0 - 0.9 * 0.5) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = adamw(model, lr=1e-3, weight_decay=0.1).param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def test_crash_during_save_keeps_the_previous_checkpoint_and_old_ones_are_pruned(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    optimizer = adamw(model, lr=0.1, weight_decay=0.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = [p.detach().clone() for p in model.parameters()]
    checkpoint.save(tmp_path, 1, model, optimizer, {"note": "first"})

    def dies_halfway(state, checkpoint_id):
        (checkpoint_id / "__0_0.distcp").write_bytes(b"partial bytes")
        raise OSError("disk full")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.dcp, "save", dies_halfway)
        with pytest.raises(OSError):
            checkpoint.save(tmp_path, 2, model, optimizer, {})
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert checkpoint.latest(tmp_path).name == "step-00000001"
    meta = checkpoint.load(checkpoint.latest(tmp_path), model, optimizer)
    assert meta == {"note": "first", "step": 1}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved))
    assert all(state["step"].item() == 1 for state in optimizer.state.values())
    for step in (2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, {})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]   # the newest 2
    with pytest.raises(ValueError, match=r"lacks 6 of this model's entries, e.g. \['0.weight', '0.bias', 'optimizer.0.weight.exp_avg'\]"):
        other = torch.nn.Sequential(torch.nn.Linear(3, 2))
        checkpoint.load(checkpoint.latest(tmp_path), other, adamw(other, lr=0.1, weight_decay=0.0))
