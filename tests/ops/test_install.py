"""`pip install pith-ops` alone must give a working pith_ops with only torch and triton (and what they need)."""
import os
import subprocess
import venv
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SMOKE = """
import importlib.util, torch
from pith_ops.swiglu import swiglu, swiglu_reference
x = torch.randn(4, 8)
assert torch.allclose(swiglu(x), swiglu_reference(x))
missing = [m for m in ("pith_engine", "pith_apps", "datasets", "safetensors", "tensorboard") if importlib.util.find_spec(m)]
print("extra modules:", missing)
"""


def test_pith_ops_installs_alone_into_a_fresh_venv(tmp_path):
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    # Pin the torch release of this interpreter so pip reuses the same wheel instead of resolving anew.
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(ROOT / "packages" / "pith-ops"), torch_pin],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    # As a user runs it: the CPU path, without the Triton interpreter that the test suite switches on.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    smoke = subprocess.run([python, "-c", SMOKE], capture_output=True, text=True, env=env)
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    assert smoke.stdout.strip() == "extra modules: []"
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in installed.split()}
    assert {"pith-ops", "torch", "triton"} <= names
    assert not names & {"pith-engine", "pith-apps", "datasets", "tensorboard", "safetensors"}
