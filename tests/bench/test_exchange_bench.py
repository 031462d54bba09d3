"""The token-exchange benchmark (bench/all_to_all.py) on 2 CPU processes over gloo: the engine's dispatch and
combine round trip is checked and timed, and each token is sent once per rank that holds any of its experts."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "all_to_all.py"


def test_the_exchange_round_trips_and_is_timed(tmp_path):
    """256 tokens, 8 experts over 2 ranks, top-2: every token goes to 1 or 2 ranks (between 256 and 512 rows, one
    rank's count); combine(dispatch(x)) with identity experts is x times its weights' sum (float32: 1e-6); a time
    and a bandwidth above 0."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(BENCH),
                           "--device", "cpu", "--tokens", "256", "--hidden", "64", "--experts", "8", "--top-k", "2",
                           "--repeats", "3"], capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "all_to_all.json").read_text())
    assert row["ranks"] == 2 and len(row["per_rank"]) == 2
    assert all(256 < r["rows_sent"] < 512 for r in row["per_rank"]), row
    assert row["relative_error"] < 1e-6 and row["median_ms"] > 0 and row["gbs"] > 0, row
