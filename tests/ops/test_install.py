"""`pip install pith-ops` alone must give a working pith_ops with only torch and triton (and what they need), its
README's example must run there as written, and its `interpret` extra must be all the Triton interpreter needs."""
import os
import re
import subprocess
import venv
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packages" / "pith-ops"
ALONE = """
import importlib.util
missing = [m for m in ("pith_engine", "pith_apps", "datasets", "safetensors", "tensorboard") if importlib.util.find_spec(m)]
print("extra modules:", missing)
"""
KERNEL = """
import torch
from pith_ops.swiglu import swiglu, swiglu_reference
x = torch.randn(4, 8)
print("kernel error", (swiglu(x, use_kernel=True) - swiglu_reference(x)).abs().max().item())
"""


def test_pith_ops_installs_alone_and_its_readme_example_runs(tmp_path):
    """In a fresh venv: pith-ops and the torch release of this interpreter (pinned, so pip reuses its wheel) install
    nothing of the other packages; the README's example prints its relative error, under its own 1e-5 bound; with
    the `interpret` extra, the SwiGLU kernel under TRITON_INTERPRET=1 matches its reference within 1e-6."""
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q"]
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    install = subprocess.run([*pip, str(PACKAGE), torch_pin], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    # as a user runs it: the CPU path, without the Triton interpreter that the test suite switches on
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    alone = subprocess.run([python, "-c", ALONE], capture_output=True, text=True, env=env)
    assert alone.returncode == 0 and alone.stdout.strip() == "extra modules: []", alone.stderr[-2000:]
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in installed.split()}
    assert {"pith-ops", "torch", "triton"} <= names
    assert not names & {"pith-engine", "pith-apps", "datasets", "tensorboard", "safetensors"}

    example = re.findall(r"```python\n(.*?)```", (PACKAGE / "README.md").read_text(), flags=re.S)[0]
    ran = subprocess.run([python, "-c", example], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert float(re.search(r"relative error (\S+),", ran.stdout).group(1)) < 1e-5

    extra = subprocess.run([*pip, f"{PACKAGE}[interpret]", torch_pin], capture_output=True, text=True)
    assert extra.returncode == 0, extra.stderr[-2000:]
    kernel = subprocess.run([python, "-c", KERNEL], capture_output=True, text=True,
                            env=env | {"TRITON_INTERPRET": "1"}, cwd=tmp_path)
    assert kernel.returncode == 0, kernel.stderr[-2000:]
    assert float(kernel.stdout.split()[-1]) < 1e-6
