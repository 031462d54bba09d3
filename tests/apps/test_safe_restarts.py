"""No lost work, round two: a run refused for any reason leaves --out as it found it, the run that --overwrite
would have replaced included (deleted only when the new run begins its first step); a checkpoint's own
description (meta.json, `latest`) is checked as its files are; the advice after a non-finite step names a
checkpoint from before the loss rose; SIGTERM to torchrun ends as the README says, and kill -9 of torchrun stops its
workers with a checkpoint."""
import json
import signal
import subprocess
import sys
import time
import zlib

import pytest

import pith_apps.run_folder as run_folder
import pith_apps.train as train_app
from distributed import free_port, run_on_processes
from hf_compare import tiny_hf_folder
from pith_engine import checkpoint
from pith_engine.parallel import LayoutError
from test_no_lost_work import QUICK, one_line_error, run


def whole_folder(out) -> dict | None:
    """Every file under out with its bytes (None: no folder), but for the lock file's note of who holds the folder,
    which each run that takes it writes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and
            p.name != ".lock"} if out.exists() else None


def refused(capsys, out, model, *flags) -> str:
    """main() for `model` with QUICK's other flags: exit 2 and one line, which it returns."""
    with pytest.raises(SystemExit) as stop:
        train_app.main([model, *QUICK[1:], "--out", str(out), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    return lines[0].removeprefix("pith-train: error: ")


def truncated_hf_folder(folder):
    tiny_hf_folder(folder)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    return folder


# checks a run makes after it has taken --out (the model, --init, the room for a checkpoint) and one before it
# (--export-hf); today's code had deleted the old run for each of the first three
REFUSALS = {
    "all layers dense": (lambda tmp: ["deepseek_v2", "--layers", "1"], "all 1 layers of the model are dense"),
    "--init unreadable": (lambda tmp: ["qwen3", "--init", str(truncated_hf_folder(tmp / "hf"))], "could not be read"),
    # (the old run's checkpoints count as free: they are deleted as the new run begins; 8 layers need more)
    "no room": (lambda tmp: ["qwen3", "--save-every", "2", "--layers", "8"], " free, and a checkpoint of this run takes about "),
    "--export-hf a file": (lambda tmp: ["qwen3", "--export-hf", str(tmp / "a-file")], "--export-hf "),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_overwrite_leaves_the_old_run_as_it_was(tmp_path, capsys, monkeypatch, case):
    out = tmp_path / "run"
    run(out, "--steps", "4", "--save-every", "2")
    before = whole_folder(out)
    flags, named = REFUSALS[case]
    flags = flags(tmp_path)
    capsys.readouterr()   # what making the --init folder printed
    if case == "no room":
        monkeypatch.setattr(run_folder.shutil, "disk_usage", lambda path: type("Usage", (), dict(free=1000))())
    (tmp_path / "a-file").write_text("mine")
    assert named in refused(capsys, out, *flags, "--steps", "2", "--overwrite")
    assert whole_folder(out) == before


def refused_under_cp(rank, world, out):
    with pytest.raises(LayoutError, match=r"^seq_len=6 must be divisible by 2 x cp = 4"):
        run(out, "--cp", "2", "--seq-len", "6", "--steps", "2", "--overwrite")


def test_a_layout_refused_after_the_folder_is_taken_leaves_the_old_run_on_two_processes(tmp_path):
    """The probe's case: a --seq-len that the cp ranks cannot split, found as the model is built (rank 0 had taken
    the folder); the old run stays whole."""
    run(tmp_path, "--steps", "4", "--save-every", "2")
    before = whole_folder(tmp_path)
    run_on_processes(2, refused_under_cp, tmp_path)
    assert whole_folder(tmp_path) == before


def test_a_refused_run_leaves_out_as_it_found_it_and_the_corrected_command_runs(tmp_path, capsys):
    """A new folder is not left behind, an empty one stays empty (no run.json, no lock file): the corrected
    command is a new run, not one refused as holding a run with no checkpoint."""
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for out in (new, empty):
        assert "are dense" in refused(capsys, out, "deepseek_v2", "--layers", "1", "--steps", "2")
    assert not new.exists() and list(empty.iterdir()) == []
    assert len(run(empty, "--steps", "2")) == 2 and json.loads((empty / "run.json").read_text())["model"] == "qwen3"


def test_an_odd_seq_len_trains_on_one_process(tmp_path):
    """An odd --seq-len was refused with a context-parallel message (2 x cp = 2) where no cp split exists."""
    losses = run(tmp_path, "--steps", "3", "--seq-len", "33", "--save-every", "0")
    assert len(losses) == 3 and all(0 < loss < 6 for loss in losses)


def reseal(meta_file, **changes):
    """meta.json with changes, its checksum recomputed as save writes it (an edit that knows the format)."""
    meta = json.loads(meta_file.read_text())
    meta.pop("meta_crc")
    meta |= changes
    meta_file.write_text(json.dumps(meta | dict(meta_crc=zlib.crc32(json.dumps(meta, sort_keys=True).encode()))))


@pytest.mark.parametrize("edit", ["step", "resealed", "moved"])
def test_an_edited_meta_json_is_refused_naming_the_newest_intact_checkpoint(tmp_path, capsys, edit):
    """The probe edited step-20's "step" to 10: resumed as step 10, it trained 11-22, replaced step-20 and pruned
    the intact step-15. Now the edit fails meta.json's checksum; an edit with the checksum redone fails the folder's
    step; a checkpoint moved to step-10 whole fails the optimizer's count of steps. Step-15 stays."""
    run(tmp_path, "--steps", "20", "--save-every", "5")
    checkpoints = tmp_path / "checkpoints"
    meta_file, newest = checkpoints / "step-00000020" / "meta.json", checkpoints / "step-00000020"
    if edit == "step":
        meta_file.write_text(meta_file.read_text().replace('"step": 20', '"step": 10'))
        why = "its meta.json was changed after it was written (it does not match its checksum)"
    elif edit == "resealed":
        reseal(meta_file, step=10)
        why = "its meta.json names step 10, not its folder's"
    else:
        reseal(meta_file, step=10)
        newest = newest.rename(checkpoints / "step-00000010")
        (checkpoints / "latest").write_text(newest.name)
        why = "its meta.json names step 10, its optimizer state step 20"
    error = one_line_error(capsys, tmp_path, "--steps", "22", "--save-every", "5", "--resume")
    assert error == (f"checkpoint '{newest}' is damaged: {why}; the newest intact one is "
                     f"'{checkpoints / 'step-00000015'}': continue with --resume-from 15")
    assert checkpoint.damage(checkpoints / "step-00000015") is None


@pytest.mark.parametrize("harm", ["missing", "damaged", "missing, newest damaged"])
def test_resume_without_a_good_latest_file_continues_from_the_newest_intact_checkpoint(tmp_path, capsys, harm):
    """It said the folder held no checkpoint and advised --overwrite, which would have deleted them."""
    straight = run(tmp_path / "straight", "--steps", "12", "--save-every", "4")
    out = tmp_path / "run"
    run(out, "--steps", "8", "--save-every", "4")
    capsys.readouterr()
    checkpoints, newest = out / "checkpoints", 8
    if harm == "damaged":
        (checkpoints / "latest").write_text("step-0000000")
    else:
        (checkpoints / "latest").unlink()
    if harm.endswith("newest damaged"):
        (checkpoints / "step-00000008" / "meta.json").write_text("{")
        newest = 4
    resumed = run(out, "--steps", "12", "--save-every", "4", "--resume")
    assert resumed == straight[newest:]   # float32 on CPU: bit-identical
    problem = "is missing" if harm != "damaged" else f"is damaged ('{checkpoints / 'latest'}' names 'step-0000000', " \
                                                     "not a checkpoint folder)"
    assert capsys.readouterr().out.splitlines()[0] == (f"--resume: {checkpoints / 'latest'} {problem}; resuming from "
                                                       f"the newest intact checkpoint {checkpoints / f'step-{newest:08d}'}")


def test_after_the_loss_rose_the_non_finite_advice_names_the_checkpoint_from_before(tmp_path, capsys, monkeypatch):
    """The loss of steps 5-7 three times its value (a spike), the gradients non-finite at step 8: step 6's
    checkpoint (mean loss of steps 1-6) is over 1.2 x step 4's, and the rise began at step 5, whose loss step 4's
    weights gave. So the advice names step 2, which pruning kept beside 4 and 6."""
    real_step = train_app.train_step

    def rising(args, parallel, device, model, optimizer, number, *rest):
        if number == 8:
            model.model.embed_tokens.weight.register_hook(lambda grad: grad * float("inf"))
        loss, *others = real_step(args, parallel, device, model, optimizer, number, *rest)
        return loss * (3 if number >= 5 else 1), *others
    monkeypatch.setattr(train_app, "train_step", rising)
    error = one_line_error(capsys, tmp_path, "--steps", "10", "--save-every", "2")
    metas = {step: checkpoint.read_meta(tmp_path / "checkpoints" / f"step-{step:08d}") for step in (2, 4, 6)}
    assert metas[6]["loss"] > 1.2 * metas[4]["loss"] and metas[6]["rose_at"] == 5 and metas[4]["rose_at"] is None
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [f"step-0000000{n}" for n in (2, 4, 6)]
    assert error.endswith("; the loss rose at step 5 (over 1.2 x the lowest saved before it), so the checkpoints from "
                          f"step 4 on hold weights from after the rise: continue from step 2 (loss "
                          f"{metas[2]['loss']:.4g}) with --resume-from 2 and a lower --lr (now 0.003)"), error


def test_sigterm_to_torchrun_saves_and_ends_as_the_readme_says(tmp_path):
    """The workers finish the step, save it and exit 0; rank 0 prints the checkpoint's line; torchrun itself, whose
    own handler raises on the signal, prints its traceback and exits 1 (README, "Several processes")."""
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                               str(free_port()), "-m", "pith_apps.train", *QUICK, "--dp", "2", "--device", "cpu",
                               "--steps", "100000", "--save-every", "50", "--out", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "checkpoints" / "latest").exists():
        time.sleep(0.2)
    launch.send_signal(signal.SIGTERM)
    out, err = launch.communicate(timeout=120)
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert len(stopped) == 1 and stopped[0].endswith("; continue with --resume"), out
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert checkpoint.damage(checkpoint.latest(tmp_path / "checkpoints")) is None
    assert checkpoint.latest(tmp_path / "checkpoints").name == f"step-{step:08d}"
    assert launch.returncode == 1 and err.strip().splitlines()[-1].startswith(
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process ") and "got signal: 15" in err


def straight_and_resumed(rank, world, root, flags):
    """The run uninterrupted, then the killed one resumed, to the same step on these two processes."""
    straight, resumed = run(root / "straight", *flags), run(root / "run", *flags, "--resume")
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(dict(straight=straight, resumed=resumed)))


def test_a_kill_of_torchrun_stops_its_workers_with_a_checkpoint_and_resume_repeats_the_run(tmp_path, monkeypatch):
    """kill -9 of torchrun alone leaves its workers (each in a session of its own) running: each sees after its step
    that its parent is gone, the ranks stop after one step, save it and exit: within 20 s of the kill (1.5-3 s here).
    --resume then trains the uninterrupted run's losses (float32 on CPU: bit-identical)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # one thread in torchrun's workers and the spawned processes alike
    flags = ["--dp", "2", "--device", "cpu", "--save-every", "2"]
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                               str(free_port()), "-m", "pith_apps.train", *QUICK, *flags, "--steps", "40", "--out",
                               str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "run" / "checkpoints" / "latest").exists():
        assert launch.poll() is None, launch.communicate()
        time.sleep(0.1)
    launch.kill()
    killed = time.monotonic()
    out, err = launch.communicate(timeout=120)   # the workers hold torchrun's pipes: read until both exited
    elapsed = time.monotonic() - killed
    stopped = [line for line in out.splitlines() if line.startswith("stopped by ")]
    assert len(stopped) == 1 and elapsed < 20, (elapsed, out, err[-3000:])
    step = int(stopped[0].split(" after step ")[1].split(":")[0])
    assert stopped[0] == (f"stopped by its launcher's death (torchrun, pid {launch.pid}) after step {step}: checkpoint "
                       f"step-{step:08d}; continue with --resume")
    assert checkpoint.latest(tmp_path / "run" / "checkpoints").name == f"step-{step:08d}"
    assert checkpoint.damage(tmp_path / "run" / "checkpoints" / f"step-{step:08d}") is None
    run_on_processes(2, straight_and_resumed, tmp_path, [*flags, "--steps", str(step + 3)])
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["resumed"]) == 3 and losses["resumed"] == losses["straight"][step:]
