"""The run folder (--out): one run's run.json (its id, model and config), checkpoints/ and TensorBoard logs
(tb/), locked while the run lives.

A new run into a folder that holds one is refused unless it continues it (--resume, --resume-from) or
replaces it (--overwrite), so that no run deletes or mixes with another's work; the replaced run is deleted only
when the new one begins its first step, every check passed. The lock is a flock on
.lock, which the kernel releases however the process ends, so a killed run never leaves a lock that
blocks the next. Everything here runs on rank 0 only; the app hands its verdict to the other ranks.
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

from pith_apps.config import ConfigError, require, write_problem
from pith_engine import checkpoint

SPIKE = 1.2   # a checkpoint saved at a loss this many times the lowest saved before it: the loss had risen


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
        the newest intact one, said in a line."""
        try:
            path, problem = checkpoint.latest(self.checkpoints), "is missing"
        except checkpoint.CheckpointError as err:
            path, problem = None, f"is damaged ({err})"
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

    def way_back(self, run_id: str, lr: float) -> str:
        """Where to continue from once the run turned non-finite, in words: its newest checkpoint, unless the loss
        it was saved at (the mean of the steps before it) had already risen over SPIKE x the lowest saved before
        it; then the newest one before that rise, whose weights a lower learning rate can still take on."""
        saved = sorted((meta["step"], path, meta["loss"]) for path, meta in checkpoint.saved_checkpoints(self.checkpoints)
                       if meta.get("run") == run_id and "loss" in meta)
        normal, lowest = None, math.inf
        for step, path, loss in saved:
            normal = (step, loss) if loss <= SPIKE * lowest else normal
            lowest = min(lowest, loss)
        if not saved or normal == saved[-1][::2]:
            return f"lower --lr (now {lr}) and continue with --resume or --resume-from"
        risen = f"the loss had already risen by the last checkpoint (step {saved[-1][0]}: {saved[-1][2]:.4g}, over " \
                f"{SPIKE} x the lowest saved before it, {lowest:.4g})"
        if normal is None:
            return f"{risen}, and none kept is from before the rise: lower --lr (now {lr}) and continue from the " \
                   f"oldest kept, --resume-from {saved[0][0]}, or start a new run in another --out"
        return f"{risen}: continue from step {normal[0]} (loss {normal[1]:.4g}) with --resume-from {normal[0]} and " \
               f"a lower --lr (now {lr})"

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

    def check_space(self, checkpoint_bytes: int):
        """Room for one more checkpoint, before the first step rather than at the first save."""
        free = shutil.disk_usage(self.out).free
        require(free > checkpoint_bytes, f"--out {self.out} has {size_text(free)} free, and a checkpoint of this run "
                f"takes about {size_text(checkpoint_bytes)}; free space, choose another --out, or --save-every 0")


def size_text(size: float) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
