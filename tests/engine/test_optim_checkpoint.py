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
        with pytest.raises(checkpoint.CheckpointError, match=r"could not write checkpoint '.*step-00000002' \(OSError: "
                           r"disk full; [0-9.]+ GB free there\); the last good checkpoint is '.*step-00000001'"):
            checkpoint.save(tmp_path, 2, model, optimizer, {})
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert checkpoint.latest(tmp_path).name == "step-00000001"
    meta = checkpoint.load(checkpoint.latest(tmp_path), model, optimizer)
    assert meta["note"] == "first" and meta["step"] == 1 and set(meta["files"]) == {".metadata", "__0_0.distcp"}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved))
    assert all(state["step"].item() == 1 for state in optimizer.state.values())
    for step in (2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, {})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]   # the newest 2
    with pytest.raises(ValueError, match=r"lacks 6 of this model's entries, e.g. \['0.weight', '0.bias', 'optimizer.0.weight.exp_avg'\]"):
        other = torch.nn.Sequential(torch.nn.Linear(3, 2))
        checkpoint.load(checkpoint.latest(tmp_path), other, adamw(other, lr=0.1, weight_decay=0.0))


def saved_linear(tmp_path, steps, run):
    model = torch.nn.Linear(3, 2)
    optimizer = adamw(model, lr=0.1, weight_decay=0.0)
    for step in steps:
        checkpoint.save(tmp_path, step, model, optimizer, {"run": run})
    return model, optimizer


def test_pruning_keeps_the_most_recent_of_this_run_and_never_another_runs(tmp_path):
    """Recency, not step number: a run that went back to step 10 keeps 60 and 20 (its newest two saves)."""
    saved_linear(tmp_path, [50], run="other")
    saved_linear(tmp_path, [10, 40, 60, 20], run="mine")
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000020", "step-00000050", "step-00000060"]
    assert checkpoint.latest(tmp_path).name == "step-00000020"


@pytest.mark.parametrize("harm,named", [
    ("truncate", r"damaged: its file __0_0.distcp has \d+ bytes, not \d+"),
    ("delete", r"damaged: its file __0_0.distcp is missing"),
    ("garble", r"damaged: its file __0_0.distcp does not match its checksum"),
    ("meta", r"incomplete or damaged: its meta.json cannot be read \(JSONDecodeError: "),
])
def test_a_damaged_checkpoint_is_named_and_the_newest_good_one_found(tmp_path, harm, named):
    model, optimizer = saved_linear(tmp_path, [1, 2], run="mine")
    newest = tmp_path / "step-00000002"
    data = newest / "__0_0.distcp"
    if harm == "truncate":
        data.write_bytes(data.read_bytes()[:-7])
    elif harm == "delete":
        data.unlink()
    elif harm == "garble":   # same size, finite bytes changed in the middle
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    else:
        (newest / "meta.json").write_text('{"step": 2, "files": ')
    with pytest.raises(checkpoint.CheckpointError, match=rf"checkpoint '{newest}' is {named}"):
        checkpoint.load(newest, model, optimizer)
    assert checkpoint.newest_good(tmp_path) == tmp_path / "step-00000001"
    assert checkpoint.load(checkpoint.newest_good(tmp_path), model, optimizer)["step"] == 1


def test_a_latest_file_that_names_no_checkpoint_is_an_error(tmp_path):
    saved_linear(tmp_path, [1], run="mine")
    (tmp_path / "latest").write_bytes(b"\x00\xffgarbage")
    with pytest.raises(checkpoint.CheckpointError, match=r"latest' names '.*', not a checkpoint folder"):
        checkpoint.latest(tmp_path)
