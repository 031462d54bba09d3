"""SIGTERM and SIGINT (Ctrl-C) during training: the run finishes its step, checkpoints and exits 0."""
import os
import signal
import sys
import threading
import time


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) ask the run to stop: it finishes the step, checkpoints and exits 0 (the ranks
    agree on the step). Another signal more than a second later exits at once, the last checkpoint intact;
    copies within the second (torchrun forwards what the shell already sent its workers) are the same request."""

    def __init__(self):
        self.asked, self.at, self.previous = None, 0.0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def handle(self, signum, frame):
        if self.asked and time.monotonic() - self.at > 1.0:
            print(f"pith-train: {signal.Signals(signum).name} again: stopping now; the last checkpoint is intact",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        if not self.asked:
            self.asked, self.at = signal.Signals(signum).name, time.monotonic()

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
