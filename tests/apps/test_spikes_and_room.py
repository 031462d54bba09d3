"""No lost work, round three: a loss spike keeps a checkpoint from before it, and its advice, followed, trains on;
a resumed dead model stops; every file DCP reads is checked and an unsealed meta.json of the new format refused;
the room checked at the start is what the run will hold at once; the messages say what is true."""
import json
import math
import os
import shutil
import signal
from types import SimpleNamespace

import pytest

import pith_apps.run_folder as run_folder
import pith_apps.stop_signals as stop_signals
import pith_apps.train as train_app
from pith_apps import convert
from pith_engine import checkpoint
from test_no_lost_work import QUICK, one_line_error, run


def kept(out) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-????????"))


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    """6 steps at --lr 3e-3, then --resume at --lr 1e4: step 7's update wrecks the weights, step 8's loss shows
    it, step 9's gradients are not finite. Also the uninterrupted 20 steps at 3e-3, and the folder as the spike
    left it (to copy for each test)."""
    root = tmp_path_factory.mktemp("spiked")
    straight = run(root / "straight", "--steps", "20", "--save-every", "0")
    run(root / "spike", "--steps", "6", "--save-every", "1")
    with pytest.raises(train_app.ConfigError) as stop:
        run(root / "spike", "--steps", "20", "--save-every", "1", "--lr", "1e4", "--resume")
    return root / "spike", str(stop.value), straight


def copy_of(spiked, tmp_path):
    shutil.copytree(spiked[0], tmp_path / "run")
    return tmp_path / "run"


def test_a_loss_spike_keeps_the_checkpoint_from_before_it_and_its_advice_trains_on(spiked, tmp_path, capsys):
    """With two checkpoints kept, step 6 (the last whose weights gave a normal loss) was pruned at step 8, and the
    advice named step 7, which holds the wrecked weights. Now step 6 stays, the advice names it and, followed,
    repeats the uninterrupted run exactly (float32 on CPU)."""
    folder, error, straight = spiked
    assert kept(folder) == [6, 7, 8]
    meta = {n: checkpoint.read_meta(folder / "checkpoints" / f"step-{n:08d}") for n in (6, 7, 8)}
    assert meta[8]["rose_at"] == 8 and meta[7]["rose_at"] is None and meta[8]["loss"] > 1.2 * meta[7]["lowest_loss"]
    assert error.startswith("step 9: the gradients became non-finite")
    assert error.endswith("; the loss rose at step 8 (over 1.2 x the lowest saved before it), so the checkpoints from "
                          f"step 7 on hold weights from after the rise: continue from step 6 (loss {meta[6]['loss']:.4g}) "
                          "with --resume-from 6 and a lower --lr (now 10000.0)"), error
    out = copy_of(spiked, tmp_path)
    resumed = run(out, "--steps", "20", "--save-every", "1", "--resume-from", "6")
    assert resumed == straight[6:] and resumed[-1] < 0.6 * math.log(257)
    assert kept(out) == [19, 20]   # the loss back down: the checkpoint from before the rise is no longer held


def test_the_spike_is_said_as_its_checkpoint_is_saved(tmp_path, capsys):
    run(tmp_path, "--steps", "6", "--save-every", "1")
    with pytest.raises(train_app.ConfigError):
        run(tmp_path, "--steps", "20", "--save-every", "1", "--lr", "1e4", "--resume")
    lines = [line for line in capsys.readouterr().out.splitlines() if "rose" in line]
    assert len(lines) == 1 and lines[0].startswith("step 8: saved after the loss rose; if it does not come back down, "
                                                   "stop the run: the loss rose at step 8"), lines
    assert lines[0].endswith("with --resume-from 6 and a lower --lr (now 10000.0)")


def test_where_the_first_update_wrecked_the_weights_no_checkpoint_is_named(tmp_path, capsys):
    """The issue's run: --lr 1e4 from the first step (its warmup's 333 already too much), a checkpoint a step.
    Step 1's checkpoint holds the wrecked weights (step 2's loss is theirs), so none is from before the rise."""
    error = one_line_error(capsys, tmp_path, "--lr", "1e4", "--save-every", "1", "--steps", "20", "--warmup", "30")
    assert error.endswith("the loss rose at step 2 (over 1.2 x the lowest saved before it), so the checkpoints from "
                          "step 1 on hold weights from after the rise, and none kept is from before: start a new run "
                          "with a lower --lr (now 10000.0) (--overwrite, or another --out)"), error


@pytest.mark.parametrize("step", [7, 8])
def test_a_resumed_dead_model_stops_in_one_line(spiked, tmp_path, capsys, step):
    """From a checkpoint after the spike, at --lr 1e-5, the run trained on at the uniform loss and exited 0. From
    step 7's the first step's loss is uniform; from step 8's its gradients are not finite too, which stops it first."""
    out = copy_of(spiked, tmp_path)
    error = one_line_error(capsys, out, "--steps", "20", "--save-every", "1", "--lr", "1e-5", "--resume-from", str(step))
    if step == 7:
        loss = float(error.split("the loss ")[1].split()[0])
        assert abs(loss - math.log(257)) < 0.01 * math.log(257), error
        assert error.startswith(f"step 8: the loss {loss:.4g} is no better than guessing uniformly among the model's "
                                "257 tokens (5.549), after it had risen: the weights it resumed from no longer learn; "
                                "nothing was saved; "), error
    else:
        assert error.startswith("step 9: the gradients became non-finite (the loss was 5.549); "), error
    assert error.endswith("continue from step 6 (loss "
                          f"{checkpoint.read_meta(out / 'checkpoints' / 'step-00000006')['loss']:.4g}) with "
                          "--resume-from 6 and a lower --lr (now 1e-05)")
    assert kept(out) == [6, 7, 8]


def strip(meta_file, *keys, files=()):
    """meta.json without its checksum and `keys` (and the `files` entries), as a hand edit leaves it."""
    meta = json.loads(meta_file.read_text())
    for key in ("meta_crc", *keys):
        meta.pop(key)
    for name in files:
        meta["files"].pop(name)
    meta_file.write_text(json.dumps(meta, indent=1))
    return meta


NEWER = ("loss", "lowest_loss", "rose_at", "optimizer")   # what a meta.json written since checksums holds


@pytest.mark.parametrize("edit", ["run", "saved_at", "loss", "unlisted and truncated"])
def test_a_meta_json_without_its_checksum_is_refused_unless_of_the_older_format(tmp_path, capsys, edit):
    """Accepted as older, an edited run (never pruned after), saved_at or loss went unnoticed, and a .distcp
    dropped from the list and truncated ended in an EOFError traceback."""
    run(tmp_path, "--steps", "4", "--save-every", "2")
    newest = tmp_path / "checkpoints" / "step-00000004"
    meta = strip(newest / "meta.json")
    if edit == "unlisted and truncated":
        meta["files"].pop("__0_0.distcp")
        data = newest / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:1000])
    else:
        meta[edit] = "another" if edit == "run" else 1.5
    (newest / "meta.json").write_text(json.dumps(meta, indent=1))
    assert one_line_error(capsys, tmp_path, "--steps", "6", "--resume") == (
        f"checkpoint '{newest}' is damaged: its meta.json has no checksum, yet holds 'loss', which only checksummed "
        f"ones hold: it was edited; the newest intact one is '{tmp_path / 'checkpoints' / 'step-00000002'}': continue "
        "with --resume-from 2")


@pytest.mark.parametrize("harm", ["none", "truncated", "missing", "no .metadata"])
def test_a_meta_json_of_the_older_format_is_read_and_every_file_dcp_reads_is_checked(tmp_path, capsys, harm):
    """Of the format written before checksums (its keys alone): resumed, but a file .metadata reads that meta.json
    does not list is still checked for its bytes."""
    straight = run(tmp_path / "straight", "--steps", "6", "--save-every", "0")
    out = tmp_path / "run"
    run(out, "--steps", "4", "--save-every", "2")
    newest = out / "checkpoints" / "step-00000004"
    data, unlisted = newest / "__0_0.distcp", {"none": (), "no .metadata": (".metadata",)}.get(harm, ("__0_0.distcp",))
    strip(newest / "meta.json", *NEWER, files=unlisted)
    if harm == "none":
        assert run(out, "--steps", "6", "--resume") == straight[4:]
        return
    if harm == "truncated":
        size = data.stat().st_size
        data.write_bytes(data.read_bytes()[:size // 2])
        why = f"its file __0_0.distcp has {size // 2} bytes, fewer than the {size} it .metadata reads"
    elif harm == "missing":
        data.unlink()
        why = "its file __0_0.distcp is missing, which .metadata reads"
    else:
        (newest / ".metadata").unlink()
        why = "its .metadata cannot be read (FileNotFoundError: "
    error = one_line_error(capsys, out, "--steps", "6", "--resume")
    assert error.startswith(f"checkpoint '{newest}' is damaged: {why}"), error
    assert error.endswith(f"the newest intact one is '{out / 'checkpoints' / 'step-00000002'}': continue with "
                          "--resume-from 2")


def free_of(monkeypatch, free: int):
    monkeypatch.setattr(run_folder.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))


def checkpoint_size(tmp_path) -> int:
    run(tmp_path / "sized", "--steps", "1")
    return sum(f.stat().st_size for f in (tmp_path / "sized" / "checkpoints" / "step-00000001").iterdir())


def test_the_room_checked_at_the_start_is_what_the_run_will_hold_at_once(tmp_path, capsys, monkeypatch):
    """Room for one checkpoint passed, and the third save failed: two kept and the one being written. Counted now:
    those the run will write (at most 3 at once, fewer for fewer saves), those of it already there, its export."""
    size = checkpoint_size(tmp_path)
    with monkeypatch.context() as patch:
        free_of(patch, int(2.5 * size))
        error = one_line_error(capsys, tmp_path / "a", "--steps", "6", "--save-every", "2")
        assert error.startswith(f"--out {tmp_path / 'a'} has ")
        assert error.startswith(f"--out {tmp_path / 'a'} has {checkpoint.size_text(2.5 * size)} free, and a "
                                "checkpoint of this run takes about ")
        assert "; it will hold 3 more at once (2 kept and the one being written; 0 here now): " in error, error
        assert not (tmp_path / "a").exists()
        assert len(run(tmp_path / "a", "--steps", "4", "--save-every", "2")) == 4   # two saves: room for 2
        free_of(patch, int(1.5 * size))
        assert len(run(tmp_path / "a", "--steps", "8", "--save-every", "2", "--resume")) == 4   # 2 here: 1 more
        free_of(patch, int(1.2 * size))   # the export (fp32 weights) about a third of a checkpoint
        error = one_line_error(capsys, tmp_path / "b", "--steps", "1", "--export-hf", str(tmp_path / "hf"))
        assert "; it will hold 1 more at once (2 kept and the one being written; 0 here now), and its export takes " \
               "about " in error and error.endswith(" in all; free space, choose another --out, or --save-every 0"), error
        free_of(patch, int(0.1 * size))
        error = one_line_error(capsys, tmp_path / "c", "--steps", "1", "--save-every", "0", "--export-hf",
                               str(tmp_path / "hf"))
        assert error.startswith(f"--out {tmp_path / 'c'} has 0.9 MB free, and its export takes about ") and \
            error.endswith("; free space, choose another --out") and "in all" not in error, error


def test_a_full_disk_is_named_without_torchs_internals(tmp_path, capsys, monkeypatch):
    """What torch's writer raises on a full disk: named as a full disk, the folder, its free bytes and a
    checkpoint's."""
    def short_write(state, checkpoint_id):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(checkpoint.dcp, "save", short_write)
    monkeypatch.setattr(checkpoint, "shutil", SimpleNamespace(rmtree=shutil.rmtree, disk_usage=lambda path:
                                                              SimpleNamespace(free=4_000_000)))
    error = one_line_error(capsys, tmp_path, "--steps", "2")
    folder = tmp_path / "checkpoints"
    assert error.startswith(f"could not write checkpoint '{folder / 'step-00000002'}' (the disk is full: {folder} has "
                            "4.0 MB free, a checkpoint takes about ") and "inline_container" not in error, error
    assert error.endswith(" MB); the last good checkpoint is none")


def test_a_second_signal_names_the_last_checkpoint_or_that_none_was_written(tmp_path, capsys, monkeypatch):
    """During the first save it said the last checkpoint was intact, with none written."""
    def exit_now(code):
        raise SystemExit(code)
    monkeypatch.setattr(stop_signals, "os", SimpleNamespace(_exit=exit_now, getppid=os.getppid))
    for latest, said in [(None, "no checkpoint was written yet"),
                         ("step-00000003", "the last checkpoint is intact (step-00000003)")]:
        if latest:
            (tmp_path / "latest").write_text(latest)
        signals = stop_signals.StopSignals(tmp_path)
        signals.handle(signal.SIGTERM, None)
        signals.at -= 2   # the second signal two seconds after the first
        with pytest.raises(SystemExit) as stop:
            signals.handle(signal.SIGTERM, None)
        assert stop.value.code == 128 + signal.SIGTERM
        assert capsys.readouterr().err == f"pith-train: SIGTERM again: stopping now; {said}\n"


def test_a_latest_file_naming_a_missing_folder_resumes_from_the_newest_intact(tmp_path, capsys):
    straight = run(tmp_path / "straight", "--steps", "6", "--save-every", "0")
    out = tmp_path / "run"
    run(out, "--steps", "4", "--save-every", "2")
    (out / "checkpoints" / "latest").write_text("step-00000009")
    capsys.readouterr()
    assert run(out, "--steps", "6", "--resume") == straight[4:]
    assert capsys.readouterr().out.splitlines()[0] == (
        f"--resume: {out / 'checkpoints' / 'latest'} names step-00000009, which is not there; resuming from the "
        f"newest intact checkpoint {out / 'checkpoints' / 'step-00000004'}")


def test_resume_from_another_models_checkpoint_names_the_flag_given(tmp_path, capsys):
    train_app.train(train_app.parse_args(["deepseek_v2", *QUICK[1:], "--out", str(tmp_path / "ds"), "--steps", "2"]))
    other = tmp_path / "ds" / "checkpoints" / "step-00000002"
    assert one_line_error(capsys, tmp_path / "qwen", "--resume-from", str(other)) == (
        f"checkpoint '{other}' was trained with another model config (deepseek_v2; this run: qwen3): give "
        "--resume-from a checkpoint of this model config")


def test_exported_and_converted_weights_get_the_mode_of_the_other_files(tmp_path, capsys):
    """Safetensors were written 0600 where the rest was 0644: under umask 027, every file is 0640."""
    previous = os.umask(0o027)
    try:
        run(tmp_path / "run", "--steps", "2", "--export-hf", str(tmp_path / "hf"))
        convert.main([str(tmp_path / "run" / "checkpoints" / "step-00000002"), str(tmp_path / "converted")])
        convert.main([str(tmp_path / "hf"), str(tmp_path / "weights")])
    finally:
        os.umask(previous)
    files = [f for name in ("run/checkpoints", "hf", "converted", "weights") for f in (tmp_path / name).rglob("*")
             if f.is_file()]
    assert {f.suffix for f in files} >= {".safetensors", ".distcp", ".json"}
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files if f.stat().st_mode & 0o777 != 0o640} == {}
