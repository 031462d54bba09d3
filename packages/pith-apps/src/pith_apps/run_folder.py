"""The run folder (--out): one run's run.json (its id, model and config), checkpoints/ and TensorBoard logs
(tb/), locked while the run lives.

A new run into a folder that holds one is refused unless it continues it (--resume, --resume-from) or
replaces it (--overwrite), so that no run deletes or mixes with another's work. The lock is a flock on
.lock, which the kernel releases however the process ends, so a killed run never leaves a lock that
blocks the next. Everything here runs on rank 0 only; the app hands its verdict to the other ranks.
"""
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from pith_apps.config import ConfigError, require, write_problem
from pith_engine import checkpoint


class RunFolder:
    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.checkpoints, self.tb = self.out / "checkpoints", self.out / "tb"
        self.run_file = self.out / "run.json"
        self.lock_file = None

    def open(self, model: str, config: dict, resume: bool, resume_from: str | None, overwrite: bool):
        """Take the folder for this run: writable, locked, holding no other run. Returns (run id, the
        checkpoint to resume from or None)."""
        self.make_writable()
        self.lock()
        if overwrite:
            for old in (self.checkpoints, self.tb, self.run_file):
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        held = self.held()
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
        if not self.run_file.is_file():
            checkpoint.write_atomic(self.run_file, json.dumps(dict(id=run_id, model=model, config=config), indent=1))
        return run_id, start

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
            if not resume:
                return None
            try:
                path = checkpoint.latest(self.checkpoints)
            except checkpoint.CheckpointError as err:
                raise ConfigError(f"{err}; {self.good_one()}") from None
            require(path is not None, f"--resume: {self.checkpoints} holds no checkpoint to resume from; " + (
                "start the run over with --overwrite instead of --resume" if self.run_file.is_file() else
                "drop --resume to start a new run"))
            return path
        path = self.checkpoints / f"step-{int(resume_from):08d}" if resume_from.isdigit() else Path(resume_from)
        steps = [p.name.removeprefix("step-").lstrip("0") for p in sorted(self.checkpoints.glob("step-????????"))]
        require(path.is_dir(), f"--resume-from {resume_from}: no checkpoint '{path}'; give a step of "
                f"{', '.join(steps) or 'none here'} or a checkpoint folder")
        return path

    def good_one(self, skip: Path | None = None) -> str:
        """Where to go from a damaged checkpoint, in words."""
        good = checkpoint.newest_good(self.checkpoints, skip)
        if good is None:
            return f"no checkpoint in {self.checkpoints} is intact; start over with --overwrite"
        return f"the newest intact one is '{good}': continue with --resume-from {int(good.name.removeprefix('step-'))}"

    def make_writable(self):
        problem = write_problem(self.out)
        require(problem is None, f"--out {self.out} is not a writable folder ({problem}); choose another --out")

    def lock(self):
        self.lock_file = open(self.out / ".lock", "a+")
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_file.seek(0)
            holder = self.lock_file.read().strip() or "another process"
            self.release()
            raise ConfigError(f"--out {self.out} is in use by the run of {holder}; wait for it to end or choose "
                              "another --out") from None
        self.lock_file.seek(0)
        self.lock_file.truncate()
        self.lock_file.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self.lock_file.flush()

    def release(self):
        if self.lock_file is not None:
            self.lock_file.close()   # closing drops the flock
            self.lock_file = None

    def check_space(self, checkpoint_bytes: int):
        """Room for one more checkpoint, before the first step rather than at the first save."""
        free = shutil.disk_usage(self.out).free
        require(free > checkpoint_bytes, f"--out {self.out} has {size_text(free)} free, and a checkpoint of this run "
                f"takes about {size_text(checkpoint_bytes)}; free space, choose another --out, or --save-every 0")


def size_text(size: float) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
