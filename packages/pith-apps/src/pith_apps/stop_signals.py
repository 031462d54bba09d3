"""SIGTERM, SIGINT (Ctrl-C) or torchrun's death during training: the run finishes its step, checkpoints and exits 0."""
import os
import signal
import sys
import threading
import time
from pathlib import Path

# torchrun starts each worker as its child in a session of its own: a kill -9 of torchrun leaves the workers running,
# each then the child of another process. Read as the app is imported, before the model is built.
LAUNCHER = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) ask the run to stop: it finishes the step, checkpoints and exits 0 (the ranks
    agree on the step). Another signal more than a second later exits at once, naming the last checkpoint (under
    `checkpoints`, which it leaves intact) or saying that none was written yet;
    copies within the second (torchrun forwards what the shell already sent its workers) are the same request.
    Under torchrun, a worker whose parent is no longer torchrun asks the same when the loop next reads `asked` (after
    every step): polled, as a parent-death signal (prctl PR_SET_PDEATHSIG) fires when the thread that started the
    worker ends, and never if torchrun died before the worker set it."""

    def __init__(self, checkpoints: Path | None = None):
        self.by, self.at, self.previous, self.checkpoints = None, 0.0, {}, checkpoints

    @property
    def asked(self) -> str | None:
        if self.by is None and LAUNCHER is not None and os.getppid() != LAUNCHER:
            self.by, self.at = f"its launcher's death (torchrun, pid {LAUNCHER})", time.monotonic()
        return self.by

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def handle(self, signum, frame):
        if self.asked and time.monotonic() - self.at > 1.0:
            pointer = self.checkpoints and self.checkpoints / "latest"
            last = f"the last checkpoint is intact ({pointer.read_text().strip()})" if pointer and pointer.is_file() \
                else "no checkpoint was written yet"
            print(f"pith-train: {signal.Signals(signum).name} again: stopping now; {last}", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        if not self.asked:
            self.by, self.at = signal.Signals(signum).name, time.monotonic()

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
