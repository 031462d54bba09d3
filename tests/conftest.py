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


def grad_tolerance(family: str, name: str) -> float:
    """The float32 relative tolerance of parameter `name`'s gradient under a layout (or compiled) against one eager
    process: 1e-5, summation order alone. Qwen3.5's delta rule solves a triangular system per chunk, which amplifies
    that rounding: 3e-5 for its parameters (1.1e-5 seen under dp 2 and cp 4), 3e-4 for those of its decay,
    A_log, dt_bias and in_proj_a, each gradient a sum over every token of terms of both signs (3.4e-5 seen under cp
    2, 1.4e-4 compiled; in_proj_a 3.7e-5 under cp 4 over 528 tokens, the sequential hand-over of the state and the
    affine scan alike)."""
    if family != "qwen3_5":
        return 1e-5
    return 3e-4 if name.endswith(("A_log", "dt_bias", "in_proj_a.weight")) else 3e-5


def recording_fp8_cache(steps: list) -> type:
    """An Fp8WeightCache class that appends (weights quantized so far, bytes of FP8 blocks held) to `steps` as each
    optimizer step begins: set as pith_apps.train.Fp8WeightCache, it records what the app's cache did."""
    from pith_ops.fp8 import Fp8WeightCache   # here: pith_ops only after TRITON_INTERPRET is set above

    class RecordingCache(Fp8WeightCache):
        def new_step(self):
            held = sum(t.nbytes for _, made in self.copies.values() for layout in made for t in layout)
            steps.append((self.quantized, held))
            super().new_step()
    return RecordingCache
