"""No lost work: a run folder holds one run, locked while it lives; checkpoints are checked on load and never
hold non-finite weights; SIGTERM / Ctrl-C finish the step and checkpoint; every bad input or environment
failure ends in one line and exit 2."""
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import pith_apps.run_folder as run_folder
import pith_apps.train as train_app
from distributed import free_port, run_on_processes
from pith_apps.train import gradient_step
from pith_engine import checkpoint
from pith_engine.cuda_graph import CaptureError

# constant LR after warmup: a run resumed with another --steps has the schedule of the uninterrupted one
QUICK = ["qwen3", "--batch-size", "8", "--seq-len", "32", "--warmup", "2", "--schedule", "constant", "--quiet"]


def run(out, *flags):
    return train_app.train(train_app.parse_args([*QUICK, "--out", str(out), *flags]))


def one_line_error(capsys, out, *flags) -> str:
    """main() with these flags must exit 2 after printing exactly one line; returns that line."""
    with pytest.raises(SystemExit) as stop:
        train_app.main([*QUICK, "--out", str(out), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("pith-train: error: "), lines
    return lines[0].removeprefix("pith-train: error: ")


def folder_state(out):
    """Every file of the run's checkpoints with its bytes, to show that nothing was touched."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "checkpoints").rglob("*")) if p.is_file()}


def test_a_new_run_into_a_held_folder_is_refused_and_overwrite_replaces_it(tmp_path, capsys):
    run(tmp_path, "--steps", "6", "--save-every", "3")
    before, run_id = folder_state(tmp_path), json.loads((tmp_path / "run.json").read_text())["id"]
    error = one_line_error(capsys, tmp_path, "--steps", "9", "--seed", "1")
    assert error == (f"--out {tmp_path} already holds a run (qwen3, checkpoints up to step-00000006); continue it "
                     "with --resume, replace it with --overwrite, or choose another --out")
    assert folder_state(tmp_path) == before
    old_logs = set((tmp_path / "tb").iterdir())
    run(tmp_path, "--steps", "2", "--overwrite")
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert not old_logs & set((tmp_path / "tb").iterdir())   # no mixed TensorBoard logs
    assert json.loads((tmp_path / "run.json").read_text())["id"] != run_id


def test_a_resume_that_would_read_other_batches_is_refused_in_one_line(tmp_path, capsys):
    """A step's batch is its samples of the seed's epoch order of the training tokens: another --seq-len,
    --batch-size, --seed, dataset or held-out part would make the resumed steps read other samples (held-out ones
    among them) with nothing said. Each is refused naming the saved value and the new; the same flags resume."""
    run(tmp_path, "--steps", "4", "--save-every", "2")
    saved = tmp_path / "checkpoints" / "step-00000004"
    for flags, changed in [(["--seq-len", "16"], "--seq-len 32 (now 16)"),
                           (["--batch-size", "4"], "--batch-size 8 (now 4)"), (["--seed", "1"], "--seed 0 (now 1)"),
                           (["--eval-every", "2"], "held-out tokens (--eval-every, --eval-batches) 0 (now 1025)")]:
        error = one_line_error(capsys, tmp_path, "--steps", "6", "--resume", *flags)
        assert error == (f"checkpoint '{saved}' was trained with {changed}: resume with its values, or start a new "
                         f"run from its weights: --init {saved} (and another --out)")
    (tmp_path / "short.txt").write_text("a short text of other stories\n" * 400)
    error = one_line_error(capsys, tmp_path, "--steps", "6", "--resume", "--data", str(tmp_path / "short.txt"))
    assert error.startswith(f"checkpoint '{saved}' was trained with dataset tokens (--data, --text-field, --tokenizer) ")
    assert len(run(tmp_path, "--steps", "6", "--resume")) == 2

def test_going_back_to_an_earlier_step_prunes_by_recency_and_latest_stays_valid(tmp_path, capsys):
    """The old bug: pruning by step number deleted every checkpoint a run wrote below the folder's highest."""
    run(tmp_path, "--steps", "30", "--save-every", "10")
    run(tmp_path, "--steps", "25", "--save-every", "5", "--resume-from", "20")
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-00000025", "step-00000030"] and checkpoint.latest(tmp_path / "checkpoints").name == names[0]
    assert len(run(tmp_path, "--steps", "27", "--resume")) == 2
    assert run(tmp_path, "--steps", "27", "--resume") == []   # done: nothing to train
    assert one_line_error(capsys, tmp_path, "--steps", "26", "--resume") == (
        "the checkpoint is at step 27, past --steps 26; give --steps above 27 to train on from it")


def test_resume_with_nothing_to_resume_and_a_missing_step_are_named(tmp_path, capsys):
    assert one_line_error(capsys, tmp_path / "new", "--resume") == (
        f"--resume: {tmp_path / 'new' / 'checkpoints'} holds no checkpoint to resume from; drop --resume to start a "
        "new run")
    run(tmp_path / "none", "--steps", "2", "--save-every", "0")   # a run that saved nothing (or died before)
    assert one_line_error(capsys, tmp_path / "none", "--steps", "2") == (
        f"--out {tmp_path / 'none'} already holds a run (qwen3, no checkpoint yet); replace it with --overwrite, or "
        "choose another --out")
    assert one_line_error(capsys, tmp_path / "none", "--resume") == (
        f"--resume: {tmp_path / 'none' / 'checkpoints'} holds no checkpoint to resume from; start the run over with "
        "--overwrite instead of --resume")
    assert len(run(tmp_path / "none", "--steps", "2", "--overwrite")) == 2
    run(tmp_path / "new", "--steps", "4", "--save-every", "2")
    assert one_line_error(capsys, tmp_path / "new", "--resume-from", "3") == (
        f"--resume-from 3: no checkpoint '{tmp_path / 'new' / 'checkpoints' / 'step-00000003'}'; give a step of 2, 4 "
        "or a checkpoint folder")


def test_weights_that_become_non_finite_stop_the_run_before_any_save(tmp_path, capsys, monkeypatch):
    """Poisoned after the update of step 10, a save step (a fault: a finite update of finite weights is finite):
    the check before the save stops the run with one line, step 5 stays the latest checkpoint and the run
    continues from it."""
    real_adamw = train_app.adamw

    def poisoned_at_step_10(model, lr, weight_decay):
        optimizer = real_adamw(model, lr, weight_decay)
        step = optimizer.step

        def poisoning_step(*args, **kwargs):
            step(*args, **kwargs)
            if next(iter(optimizer.state.values()))["step"].item() == 10:
                with torch.no_grad():
                    next(model.parameters())[0, 0] = float("nan")
        optimizer.step = poisoning_step
        return optimizer
    monkeypatch.setattr(train_app, "adamw", poisoned_at_step_10)
    assert one_line_error(capsys, tmp_path, "--steps", "12", "--save-every", "5") == (
        "step 10: the weights became non-finite; nothing of it was saved; the last checkpoint is intact; lower --lr "
        "(now 0.003) and continue with --resume or --resume-from")
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step-00000005"
    monkeypatch.setattr(train_app, "adamw", real_adamw)
    assert len(run(tmp_path, "--steps", "10", "--save-every", "5", "--resume")) == 5


def test_a_non_finite_gradient_skips_the_update_and_stops_the_run_before_any_save(tmp_path, capsys, monkeypatch):
    """A gradient that overflows at step 7: the fused step leaves the weights as they were and the run stops
    with one line; step 5 stays the latest checkpoint."""
    real_step = train_app.train_step
    seen = {}

    def overflowing_at_step_7(args, parallel, device, model, optimizer, number, *rest):
        if number == 7:
            seen.update(model=model, weights=[p.detach().clone() for p in model.parameters()])
            model.model.embed_tokens.weight.register_hook(lambda grad: grad * float("inf"))
        return real_step(args, parallel, device, model, optimizer, number, *rest)
    monkeypatch.setattr(train_app, "train_step", overflowing_at_step_7)
    error = one_line_error(capsys, tmp_path, "--steps", "10", "--save-every", "5")
    assert error.startswith("step 7: the gradients became non-finite (the loss was ")
    assert error.endswith("); the update was skipped and nothing of it was saved; the last checkpoint is intact; "
                          "lower --lr (now 0.003) and continue with --resume or --resume-from")
    assert all(torch.equal(p, w) for p, w in zip(seen["model"].parameters(), seen["weights"]))
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step-00000005"


def test_a_damaged_checkpoint_names_the_newest_intact_one_which_resume_from_takes(tmp_path, capsys):
    straight = run(tmp_path / "straight", "--steps", "12", "--save-every", "4")
    run(tmp_path / "run", "--steps", "8", "--save-every", "4")
    checkpoints = tmp_path / "run" / "checkpoints"
    data = checkpoints / "step-00000008" / "__0_0.distcp"   # finite garbage inside the data: same size, one byte
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    assert one_line_error(capsys, tmp_path / "run", "--steps", "12", "--save-every", "4", "--resume") == (
        f"checkpoint '{checkpoints / 'step-00000008'}' is damaged: its file __0_0.distcp does not match its checksum; "
        f"the newest intact one is '{checkpoints / 'step-00000004'}': continue with --resume-from 4")
    resumed = run(tmp_path / "run", "--steps", "12", "--save-every", "4", "--resume-from", "4")
    assert resumed == straight[4:]   # float32 on CPU: bit-identical


def test_no_room_for_a_checkpoint_is_named_before_the_first_step_and_a_failed_save_keeps_latest(
        tmp_path, capsys, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(run_folder.shutil, "disk_usage", lambda path: SimpleNamespace(free=1_000_000))
        error = one_line_error(capsys, tmp_path / "a", "--steps", "4")
    assert error.startswith(f"--out {tmp_path / 'a'} has 1.0 MB free, and a checkpoint of this run takes about ")
    assert not (tmp_path / "a" / "tb").exists()   # stopped before the first step
    run(tmp_path / "b", "--steps", "2", "--save-every", "2")

    def disk_full(state, checkpoint_id):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.dcp, "save", disk_full)
    error = one_line_error(capsys, tmp_path / "b", "--steps", "4", "--save-every", "2", "--resume")
    assert error.startswith(f"could not write checkpoint '{tmp_path / 'b' / 'checkpoints' / 'step-00000004'}' "
                            f"(the disk is full: {tmp_path / 'b' / 'checkpoints'} has ")
    assert error.endswith(f"the last good checkpoint is '{tmp_path / 'b' / 'checkpoints' / 'step-00000002'}'")


@pytest.mark.parametrize("data,named", [
    ("", "holds no text (its files are empty)"),
    ("\n\n\n", "holds no text (every 'text' is empty)"),
    ('{"text": "ok"}\n{"text": broken\n', "could not be read: data.jsonl line 2: Expecting value: line 1 column 10"),
    (b"good line\nbad \xff byte\n", "could not be read: data.txt line 2: 'utf-8' codec can't decode byte 0xff"),
    ('{"text": "ok"}\n{"text": 5}\n', "has a 'text' of type int in row 2; every 'text' must be a string"),
])
def test_unreadable_data_is_named_in_one_line(tmp_path, capsys, data, named):
    path = tmp_path / ("data.jsonl" if str(data).startswith(("{", "b'{")) else "data.txt")
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    assert one_line_error(capsys, tmp_path / "out", "--data", str(path)).startswith(f"dataset '{path}' {named}")


def test_an_out_that_cannot_be_a_writable_folder_and_contradicting_flags_are_named(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert one_line_error(capsys, tmp_path / "file" / "run") == (
        f"--out {tmp_path / 'file' / 'run'} is not a writable folder (Not a directory); choose another --out")
    assert one_line_error(capsys, tmp_path / "run", "--resume", "--overwrite") == (
        "--overwrite starts the run over; it cannot go with --resume or --resume-from")
    assert one_line_error(capsys, tmp_path / "run", "--resume", "--resume-from", "2") == (
        "--resume continues from the newest checkpoint, --resume-from from the one it names: give one of them")


@pytest.mark.parametrize("flags,named", [
    (["--lr", "inf"], "--lr=inf must be a finite number > 0"), (["--lr", "nan"], "--lr=nan must be a finite number > 0"),
    (["--clip", "0"], "--clip=0.0 must be a finite number > 0"),
    (["--warmup", "-1"], "--warmup=-1 must be a finite number >= 0"),
    (["--weight-decay", "-5"], "--weight-decay=-5.0 must be a finite number >= 0"),
    (["--weight-decay", "-0.5"], "--weight-decay=-0.5 must be a finite number >= 0"),
    (["--steps", "2.5"], "argument --steps: invalid int value: '2.5'; see --help"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16' (choose from 'float32', 'bfloat16'); see "
     "--help"),
])
def test_a_bad_value_is_named_in_one_line(tmp_path, capsys, flags, named):
    assert one_line_error(capsys, tmp_path / "run", *flags) == named
    assert not (tmp_path / "run").exists()


def test_running_out_of_memory_or_an_interrupt_before_the_first_step_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """Out of memory names the way out (the rank that ran out under torchrun); Ctrl-C before the first step (while
    the model is built: StopSignals takes it from the first step on) says the checkpoints are intact."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "139.8 GiB\nmore lines")
    monkeypatch.setattr(train_app, "build_model", out_of_memory)
    assert one_line_error(capsys, tmp_path / "a") == (
        "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.8 GiB; "
        "lower --micro-batch-size or --seq-len, or spread the model over more GPUs (--ep, --pp, --dp): "
        "skills/pith-apps/estimate-memory tells what a layout needs")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_app, "build_model", interrupted)
    with pytest.raises(SystemExit) as stop:
        train_app.main([*QUICK, "--out", str(tmp_path / "b")])
    assert stop.value.code == 130 and capsys.readouterr().err.strip().splitlines() == [
        "pith-train: interrupted; the checkpoints written so far are intact"]


def test_a_read_only_out_is_named_in_one_line(tmp_path, capsys):
    # permissions do not stop root, and nothing can create a file in sysfs: root's read-only folder
    if os.geteuid() == 0:
        read_only = "/sys"
    else:
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
    assert one_line_error(capsys, read_only) == (
        f"--out {read_only} is not a writable folder (Permission denied); choose another --out")


def test_a_step_that_cannot_be_captured_as_a_cuda_graph_ends_in_one_line_naming_the_way_out(tmp_path, capsys,
                                                                                             monkeypatch):
    """What StepGraph raises when a capture fails (seen on the GPU: a host sync inside the step) reaches the user as
    one line: the failing step, the reason and --no-cuda-graph. Here a stand-in graph fails at step 3 as a capture
    would; the real capture runs in the GPU tests."""
    def graph_failing_at_step_3(args, parallel, device, model, optimizer):
        steps = []

        def step(*inputs):
            steps.append(len(steps) + 1)
            if len(steps) == 3:
                raise CaptureError("the step could not be captured as a CUDA graph (operation not permitted when "
                                   "stream is capturing)")
            return train_app.gradient_step(args, parallel, model, optimizer, *inputs)
        return step
    monkeypatch.setattr(train_app, "step_graph", graph_failing_at_step_3)
    assert one_line_error(capsys, tmp_path / "out", "--steps", "5") == (
        "step 3: the step could not be captured as a CUDA graph (operation not permitted when stream is capturing); "
        "nothing of this step was saved: run again with --no-cuda-graph (and --resume to continue from the last "
        "checkpoint, or --overwrite to start over)")


def start(out, *flags) -> subprocess.Popen:
    """The app in its own process; returns once it holds the run folder's lock."""
    process = subprocess.Popen([sys.executable, "-m", "pith_apps.train", *QUICK, "--out", str(out), *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        lock = out / ".lock"
        if lock.is_file() and f"pid {process.pid} " in lock.read_text():
            return process
        assert process.poll() is None, process.communicate()
        time.sleep(0.1)
    raise AssertionError("the run never took its lock")


def test_a_second_run_on_a_live_folder_is_refused_and_the_first_finishes_intact(tmp_path):
    first = start(tmp_path, "--steps", "150", "--save-every", "50")
    second = subprocess.run([sys.executable, "-m", "pith_apps.train", *QUICK, "--out", str(tmp_path), "--steps", "150",
                             "--resume"], capture_output=True, text=True)
    assert second.returncode == 2
    assert second.stderr.strip().startswith(f"pith-train: error: --out {tmp_path} is in use by the run of pid "
                                            f"{first.pid} on ") and len(second.stderr.strip().splitlines()) == 1
    assert first.wait(timeout=300) == 0, first.communicate()
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert names == ["step-00000100", "step-00000150"] and all(
        checkpoint.damage(tmp_path / "checkpoints" / name) is None for name in names)


def test_a_killed_runs_lock_does_not_block_the_next(tmp_path):
    first = start(tmp_path, "--steps", "3000", "--save-every", "1")
    while checkpoint.latest(tmp_path / "checkpoints") is None:
        time.sleep(0.1)
    first.kill()
    first.wait()
    assert len(run(tmp_path, "--steps", "3", "--resume")) <= 2


def test_a_file_system_without_locks_is_named_and_the_run_goes_on(tmp_path, monkeypatch):
    """flock failing as on a shared file system mounted without it (ENOSYS): one warning naming --out and what is
    not kept apart, and the run trains its 2 steps and saves (its loss finite)."""
    def no_locks(*args):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(run_folder, "fcntl", SimpleNamespace(flock=no_locks, LOCK_EX=2, LOCK_NB=4))
    with pytest.warns(UserWarning, match=rf"--out {tmp_path} takes no file lock \(Function not implemented\): a second "
                      "run started on it would not be refused"):
        losses = train_app.train(train_app.parse_args(["qwen3", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                                                       "--out", str(tmp_path), "--quiet", "--device", "cpu"]))
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert checkpoint.latest(tmp_path / "checkpoints").name == "step-00000002"


def stop_during(step_to_signal, sig):
    """gradient_step that sends this process `sig` after the forwards and backwards of step `step_to_signal`
    (counted from 1), before its all-reduce: the signal comes while the step works."""
    steps = itertools.count(1)

    def step_then_signal(*args, **kwargs):
        done = gradient_step(*args, **kwargs)
        if next(steps) == step_to_signal:
            os.kill(os.getpid(), sig)
        return done
    return step_then_signal


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_and_resume_repeats_the_uninterrupted_run(tmp_path, monkeypatch, sig):
    flags = ["--steps", "20", "--save-every", "100"]
    straight = run(tmp_path / "straight", *flags)
    monkeypatch.setattr(train_app, "gradient_step", stop_during(12, sig))
    stopped = run(tmp_path / "stopped", *flags)
    assert len(stopped) == 12 and checkpoint.latest(tmp_path / "stopped" / "checkpoints").name == "step-00000012"
    monkeypatch.setattr(train_app, "gradient_step", gradient_step)
    assert stopped + run(tmp_path / "stopped", *flags, "--resume") == straight   # float32 CPU: bit-identical


def signalled_on_two_processes(rank, world, root):
    """Only rank 0 gets SIGTERM, at step 6: both ranks stop after step 6 and save it together."""
    flags = ["--steps", "12", "--save-every", "100", "--dp", "2"]
    straight = run(root / "straight", *flags)
    if rank == 0:
        train_app.gradient_step = stop_during(6, signal.SIGTERM)
    stopped = run(root / "stopped", *flags)
    train_app.gradient_step = gradient_step
    resumed = run(root / "stopped", *flags, "--resume")
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(dict(straight=straight, stopped=stopped, resumed=resumed)))


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_resume_repeats_the_run(tmp_path):
    run_on_processes(2, signalled_on_two_processes, tmp_path)
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert len(losses["stopped"]) == 6 and losses["stopped"] + losses["resumed"] == losses["straight"]


def test_a_second_signal_a_second_later_exits_at_once_and_the_last_checkpoint_stays_intact(tmp_path):
    slow = ["--batch-size", "128", "--seq-len", "512", "--steps", "3000", "--save-every", "1"]   # steps of seconds
    first = start(tmp_path, *slow)
    while checkpoint.latest(tmp_path / "checkpoints") is None:
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    time.sleep(1.2)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM and "SIGTERM again: stopping now; the last checkpoint is intact" in err
    assert checkpoint.damage(checkpoint.latest(tmp_path / "checkpoints")) is None


def test_a_layout_error_under_torchrun_is_printed_once_and_every_rank_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "pith_apps.train", *QUICK, "--ep", "3", "--device", "cpu",
                             "--out", str(tmp_path)], capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert output.count("pith-train: error:") == 1 and "pp x dp x cp x ep = 1 x 1 x 1 x 3 = 3, but the world has 2" in output
    assert result.returncode != 0 and output.count("exitcode  : 2") >= 1, output[-3000:]
