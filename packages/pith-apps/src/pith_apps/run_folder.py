"""The run folder (--out): one run's run.json (its id, model and config), checkpoints/ and TensorBoard logs
(tb/), locked while the run lives.

A new run into a folder that holds one is refused unless it continues it (--resume, --resume-from) or
replaces it (--overwrite), so that no run deletes or mixes with another's work; the replaced run is deleted only
when the new one begins its first step, every check passed. The lock is a flock on
.lock, which the kernel releases however the process ends, so a killed run never leaves a lock that
blocks the next. RunFolder runs on rank 0 only, the app handing its verdict to the other ranks; LossWatch, which
judges the loss each checkpoint is saved at, on every rank alike.
"""
import fcntl
import json
import math
import os
import shutil
import socket
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from pith_apps.config import ConfigError, NonFinite, require, write_problem
from pith_engine import checkpoint
from pith_engine.checkpoint import KEEP, size_text, training_state
from pith_engine.data_parallel import local_part
from pith_engine.parallel import Parallel

SPIKE = 1.2   # a checkpoint saved at a loss over this many times the lowest saved before it: the loss had risen


class RunFolder:
    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.checkpoints, self.tb = self.out / "checkpoints", self.out / "tb"
        self.run_file = self.out / "run.json"
        self.lock_file, self.record, self.made = None, None, []

    def open(self, model: str, config: dict, resume: bool, resume_from: str | None, overwrite: bool):
        """Take the folder for this run: writable, locked, holding no other run (unless --overwrite replaces it,
        at `begin`). Writes nothing else: a run refused before `begin` leaves the folder as it found it. Returns
        (run id, the checkpoint to resume from or None)."""
        self.made = [path for path in (self.out, self.out / ".lock") if not path.exists()]
        self.make_writable()
        self.lock()
        held = None if overwrite else self.held()
        go_on = "continue it with --resume, " if self.latest_step() else ""   # (none saved: nothing to continue)
        require(not held or resume or resume_from, f"--out {self.out} already holds a run ({held}); {go_on}replace "
                "it with --overwrite, or choose another --out")
        if held:
            saved = self.read_run()
            require(saved.get("config") == config, f"--out {self.out} holds a run of another model config "
                    f"({saved.get('model', 'unknown family')}; this run: {model}); choose another --out, or replace "
                    "that run with --overwrite")
        start = self.resume_point(resume, resume_from)
        run_id = self.read_run().get("id") if held else uuid.uuid4().hex
        self.record = dict(id=run_id, model=model, config=config), overwrite
        return run_id, start

    def begin(self):
        """The run is about to take its first step, every check passed: only now is the run it replaces
        (--overwrite) deleted, its checkpoints and logs, and this run recorded in run.json."""
        record, overwrite = self.record
        if overwrite:
            for old in (self.checkpoints, self.tb, self.run_file):
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        if not self.run_file.is_file():
            checkpoint.write_atomic(self.run_file, json.dumps(record, indent=1))
        self.made = []

    def latest_step(self) -> str | None:
        steps = sorted(self.checkpoints.glob("step-????????"))
        return steps[-1].name if steps else None

    def held(self) -> str | None:
        """What run the folder holds, in words (None: none)."""
        latest = self.latest_step()
        if not latest and not self.run_file.is_file():
            return None
        model = self.read_run().get("model", "a model") if self.run_file.is_file() else "a model"
        return f"{model}, checkpoints up to {latest}" if latest else f"{model}, no checkpoint yet"

    def read_run(self) -> dict:
        if not self.run_file.is_file():
            return {}
        try:
            return json.loads(self.run_file.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"'{self.run_file}' cannot be read ({err}); repair or delete it") from None

    def resume_point(self, resume: bool, resume_from: str | None) -> Path | None:
        """The checkpoint --resume (the newest) or --resume-from (a step here, or any checkpoint folder) names."""
        if resume_from is None:
            return self.newest() if resume else None
        path = self.checkpoints / f"step-{int(resume_from):08d}" if resume_from.isdigit() else Path(resume_from)
        steps = [p.name.removeprefix("step-").lstrip("0") for p in sorted(self.checkpoints.glob("step-????????"))]
        require(path.is_dir(), f"--resume-from {resume_from}: no checkpoint '{path}'; give a step of "
                f"{', '.join(steps) or 'none here'} or a checkpoint folder")
        return path

    def newest(self) -> Path:
        """What --resume continues from: the checkpoint `latest` names, or where that file is missing or damaged,
        or names a folder that is not there, the newest intact one, said in a line."""
        try:
            path, problem = checkpoint.latest(self.checkpoints), "is missing"
        except checkpoint.CheckpointError as err:
            path, problem = None, f"is damaged ({err})"
        if path is not None and not path.is_dir():
            path, problem = None, f"names {path.name}, which is not there"
        if path is not None:
            return path
        steps = self.latest_step()
        require(steps, f"--resume: {self.checkpoints} holds no checkpoint to resume from; " + (
            "start the run over with --overwrite instead of --resume" if self.run_file.is_file() else
            "drop --resume to start a new run"))
        good = checkpoint.newest_good(self.checkpoints)
        require(good, f"--resume: none of the checkpoints in {self.checkpoints} is intact; start the run over with "
                "--overwrite")
        print(f"--resume: {self.checkpoints / 'latest'} {problem}; resuming from the newest intact checkpoint {good}")
        return good

    def good_one(self, skip: Path | None = None) -> str:
        """Where to go from a damaged checkpoint, in words."""
        good = checkpoint.newest_good(self.checkpoints, skip)
        if good is None:
            return f"no checkpoint in {self.checkpoints} is intact; start over with --overwrite"
        return f"the newest intact one is '{good}': continue with --resume-from {int(good.name.removeprefix('step-'))}"

    def way_back(self, run_id: str, lr: float, before: int | None = None) -> str:
        """Where to continue from once the run turned non-finite or dead, in words: the newest checkpoint of the run
        from before step `before` (the weights that failed: a resume from them repeats the failed step exactly) and,
        where the last one was saved after the loss rose (its meta's rose_at, LossWatch), from before that rise's
        weights (step rose_at - 1), which pruning keeps."""
        saved = [meta for _, meta in checkpoint.saved_checkpoints(self.checkpoints) if meta.get("run") == run_id]
        if not saved:
            return f"no checkpoint was saved yet: lower --lr (now {lr}) and start over with --overwrite"
        rose = saved[-1].get("rose_at")
        limit = min(before or math.inf, rose - 1 if rose else math.inf)
        good = [meta for meta in saved if meta["step"] < limit and not meta.get("rose_at")]
        if good and good[-1] is saved[-1]:
            return f"the last checkpoint is intact; lower --lr (now {lr}) and continue with --resume or --resume-from"
        why = f"the loss rose at step {rose} (over {SPIKE} x the lowest saved before it), so the checkpoints from " \
              f"step {rose - 1} on hold weights from after the rise" if rose and rose - 1 <= (before or math.inf) else \
              f"the checkpoints from step {before} on hold the weights that failed (a resume repeats the failure)"
        if not good:
            return f"{why}, and none kept is from before: start a new run with a lower --lr (now {lr}) (--overwrite, " \
                   "or another --out)"
        step = good[-1]["step"]
        return f"{why}: continue from step {step} (loss {good[-1]['loss']:.4g}) with --resume-from {step} and a lower " \
               f"--lr (now {lr})"

    def make_writable(self):
        problem = write_problem(self.out)
        require(problem is None, f"--out {self.out} is not a writable folder ({problem}); choose another --out")

    def lock(self):
        lock_file = open(self.out / ".lock", "a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "another process"
            lock_file.close()
            raise ConfigError(f"--out {self.out} is in use by the run of {holder}; wait for it to end or choose "
                              "another --out") from None
        except OSError as err:   # a file system without flock (some shared ones): run, but say what is not kept
            warnings.warn(f"--out {self.out} takes no file lock ({err.strerror}): a second run started on it would not "
                          "be refused while this one runs")
        self.lock_file = lock_file
        self.lock_file.seek(0)
        self.lock_file.truncate()
        self.lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self.lock_file.flush()

    def release(self):
        """Drop the lock; a run that never began removes what opening made (the folder, or its .lock)."""
        if self.lock_file is not None:
            for path in reversed(self.made):   # still locked: no other run is in the folder
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            self.lock_file.close()   # closing drops the flock
            self.lock_file = None

    def check_space(self, checkpoint_bytes: int, saves: int, export: tuple[str, int] | None = None):
        """Room, before the first step rather than at a save, for what the run will hold at once: the KEEP
        checkpoints kept and the one being written (of the `saves` it will write, beyond this run's already here),
        and the export (folder, bytes), on --out's disk where that is the same disk."""
        overwrite = bool(self.record and self.record[1])
        held = 0 if overwrite else len(list(self.checkpoints.glob("step-????????")))
        writes = max(1, min(KEEP + 1, held + saves) - held) if saves else 0
        free = shutil.disk_usage(self.out).free
        if overwrite and self.checkpoints.is_dir():   # the run it replaces is deleted as this one begins
            free += sum(f.stat().st_size for f in self.checkpoints.rglob("*") if f.is_file())
        need, parts = writes * checkpoint_bytes, [
            f"a checkpoint of this run takes about {size_text(checkpoint_bytes)}; it will hold {writes} more at once "
            f"({KEEP} kept and the one being written; {held} here now)"] if writes else []
        if export:
            target = Path(export[0]).absolute()
            disk = next(folder for folder in (target, *target.parents) if folder.exists())
            if disk.stat().st_dev == self.out.stat().st_dev:
                need, parts = need + export[1], [*parts, f"its export takes about {size_text(export[1])}"]
            else:
                room = shutil.disk_usage(disk).free
                require(room > export[1], f"--export-hf {export[0]} has {size_text(room)} free on its disk, and the "
                        f"export takes about {size_text(export[1])}; free space or choose another --export-hf")
        total = f": {size_text(need)} in all" if len(parts) > 1 or writes > 1 else ""
        require(free > need or not parts, f"--out {self.out} has {size_text(free)} free, and {', and '.join(parts)}"
                f"{total}; free space, choose another --out{', or --save-every 0' if writes else ''}")


class LossWatch:
    """Judges each checkpoint by the loss it is saved at (the mean of the 10 steps before it): over SPIKE x the lowest
    saved before it in the run's history (the checkpoints it resumed through included), the loss has risen, and its
    meta records rose_at, the first of those steps over that (the same through the rise). A checkpoint's weights
    give the next step's loss, so those of step rose_at - 1 on are from after the rise, and pruning keeps the newest
    one before them (checkpoint.prune). A resumed run whose first step's loss is no better than guessing uniformly
    over the vocabulary (within 1% of ln vocab_size, or above), where the loss had risen (by its checkpoint, or at
    this step), holds a dead model: `dead_line` says so."""

    def __init__(self, resumed: dict | None):
        resumed = resumed or {}
        self.lowest = resumed.get("lowest_loss", resumed.get("loss", math.inf))
        self.resumed, self.rose_at, self.start = bool(resumed), resumed.get("rose_at"), resumed.get("step", 0)

    def judged(self, losses: list[float]) -> dict:
        """What a checkpoint's meta.json records of the loss, the run's `losses` so far judged; rose_now: the rise
        is new at this checkpoint."""
        loss, over = sum(losses[-10:]) / len(losses[-10:]), SPIKE * self.lowest
        before = self.start + max(0, len(losses) - 10)   # the step before the window's first
        first = next((before + 1 + i for i, x in enumerate(losses[-10:]) if x > over), None)
        self.rose_now = loss > over and not self.rose_at
        self.rose_at = (self.rose_at or first) if loss > over else None
        self.lowest = min(self.lowest, loss)
        return dict(loss=loss, lowest_loss=self.lowest, rose_at=self.rose_at)

    def dead_line(self, loss: float, vocab_size: int) -> str | None:
        """Read on a resumed run's first step."""
        uniform = math.log(vocab_size)
        if self.resumed and loss > 0.99 * uniform and (self.rose_at or loss > SPIKE * self.lowest):
            return f"the loss {loss:.4g} is no better than guessing uniformly among the model's {vocab_size} tokens " \
                   f"({uniform:.4g}), after it had risen: the weights it resumed from no longer learn; nothing was saved"
        return None


def checkpoint_bytes(model, optimizer, parallel: Parallel) -> tuple[int, int]:
    """About what one checkpoint takes, and the model's count of weights: the tensors a checkpoint holds
    (checkpoint.training_state: the fp32 weights and the optimizer's state, AdamW's two moments of a parameter or
    Muon's one momentum), each element once (HSDP's replicas hold copies). Makes the optimizer's state now, the
    zeros its first step would make, as a resume's load does."""
    mine = [sum(local_part(t).nbytes for t in training_state(model, optimizer).values()),
            sum(local_part(p).numel() for p in model.parameters())]
    sizes = torch.tensor(mine, dtype=torch.float64, device=next(model.parameters()).device)   # NCCL's: on the GPU
    if parallel.world > 1:
        dist.all_reduce(sizes)
    return tuple(int(n) // parallel.dp_replicate for n in sizes.tolist())


def require_finite_weights(model, parallel: Parallel, number: int):
    """Before a save. A step whose gradient norm is not finite is skipped, and AdamW moves a weight by about lr
    at most, so only a fault (bad memory, a bug, a weight written by other code) gets here: checked at saves
    only, as it reads every weight."""
    total = torch.stack(torch._foreach_norm([local_part(p.detach()) for p in model.parameters()])).sum()
    if parallel.world > 1:
        dist.all_reduce(total)
    if not math.isfinite(total.item()):
        raise NonFinite(f"step {number}: the weights became non-finite; nothing of it was saved", number)


def save(folder, step: int, model, optimizer, meta: dict, size: int):
    try:
        checkpoint.save(folder.checkpoints, step, model, optimizer, meta, size)
    except checkpoint.CheckpointError as err:
        raise ConfigError(str(err)) from None
