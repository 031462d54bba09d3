"""Opt-in (PITH_SLOW=1, several minutes): runs killed with SIGKILL at random moments (starting up, training,
inside a save, after its rename), then resumed until done, end exactly as the uninterrupted run: the final
checkpoint's data file (every weight, AdamW moment and RNG state) is byte-identical."""
import os
import random
import subprocess
import sys
import time

import pytest

from pith_engine import checkpoint

FLAGS = ["qwen3", "--batch-size", "8", "--seq-len", "32", "--warmup", "2", "--steps", "40", "--save-every", "5",
         "--quiet"]
TRIALS = 20


def final_data(out):
    return (out / "checkpoints" / "step-00000040" / "__0_0.distcp").read_bytes()


def launch(out, *flags):
    return subprocess.Popen([sys.executable, "-m", "pith_apps.train", *FLAGS, "--out", str(out), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(os.environ.get("PITH_SLOW") != "1", reason="opt-in: PITH_SLOW=1 (about 20 killed runs)")
def test_runs_killed_at_random_moments_resume_to_the_uninterrupted_result(tmp_path):
    tic = time.perf_counter()
    assert launch(tmp_path / "straight").wait() == 0
    duration = time.perf_counter() - tic
    expected = final_data(tmp_path / "straight")
    generator = random.Random(0)
    for trial in range(TRIALS):
        out = tmp_path / f"trial-{trial}"
        process, kills = launch(out), 0
        while True:
            if kills < 2:   # at most two kills a trial, each at a random moment of that process's life
                time.sleep(generator.uniform(0.2, duration))
                process.kill()
                kills += 1
            code = process.wait()
            if code == 0:
                break
            assert code == -9, process.stderr.read()
            # a run killed before its first checkpoint is started over; any other resumes
            has_checkpoint = (out / "checkpoints" / "latest").is_file()
            process = launch(out, "--resume" if has_checkpoint else "--overwrite")
        assert final_data(out) == expected, f"trial {trial}"
        assert checkpoint.damage(checkpoint.latest(out / "checkpoints")) is None
