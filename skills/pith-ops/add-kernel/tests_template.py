"""The template kernel's test, to copy as tests/ops/test_NAME.py (there `KERNEL_DEVICE` and the interpreter
come from tests/conftest.py: import them instead of the lines marked "standalone"). The kernel against its torch
reference, forward and backward, in float32 and bfloat16, on shapes that are and are not whole blocks."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():   # standalone: before the kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # standalone
sys.path.insert(0, os.path.dirname(__file__))   # standalone: after copying, `from pith_ops.NAME import ...`
from kernel_template import scale_rows  # noqa: E402


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("shape", [(16, 128), (37, 300), (1, 5)])
def test_the_kernel_is_its_reference_forward_and_backward(shape, dtype, tolerance):
    """float32: the same fp32 products (1e-6); bfloat16: one rounding of the output (8e-3)."""
    torch.manual_seed(0)
    x = torch.randn(*shape, device=KERNEL_DEVICE).to(dtype).requires_grad_()
    scale = torch.randn(shape[0], device=KERNEL_DEVICE).to(dtype).requires_grad_()
    grad = torch.randn(*shape, device=KERNEL_DEVICE).to(dtype)
    results = []
    for use_kernel in (True, False):
        out = scale_rows(x, scale, use_kernel=use_kernel)
        out.backward(grad)
        results.append((out.detach(), x.grad, scale.grad))
        x.grad = scale.grad = None
    for got, wanted in zip(*results):
        assert got.dtype == wanted.dtype and relative_error(got, wanted) < tolerance
