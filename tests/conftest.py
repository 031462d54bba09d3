"""Shared test setup. Triton kernels run on CPU only through Triton's interpreter, which must be switched
on before the first kernel is defined, so it is set here, before any test module imports pith_ops."""
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the app's default --data-cache (and Hugging Face's caches) in a folder of this test session, not the user's
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pith-tests-cache-")

# Where Triton kernels run in tests: the GPU when there is one, else the CPU under the interpreter.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm of the difference over the norm of the expected value, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
