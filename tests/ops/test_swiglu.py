import pytest
import torch

from conftest import relative_error
from pith_ops.swiglu import swiglu, swiglu_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: the kernel and torch differ only by rounding in sigmoid/exp. bfloat16: both compute in fp32 and
# round once to bf16 (relative step 2**-8), so results may differ by one bf16 ulp per element.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (5, 2 * 96), (3, 4, 2 * 1500), (2, 2 * 1024)])
def test_swiglu_kernel_matches_reference_forward_and_backward(shape, dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    grad_out = torch.randn(*shape[:-1], shape[-1] // 2, device=DEVICE).to(dtype)

    kernel_in = gate_up.clone().requires_grad_()
    out = swiglu(kernel_in, use_kernel=True)
    out.backward(grad_out)

    reference_in = gate_up.float().requires_grad_()
    expected = swiglu_reference(reference_in)
    expected.backward(grad_out.float())

    assert out.dtype == dtype and out.shape == expected.shape
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert relative_error(kernel_in.grad, reference_in.grad) < TOLERANCE[dtype]


def test_swiglu_with_no_rows_returns_empty():
    gate_up = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    out = swiglu(gate_up, use_kernel=True)
    out.sum().backward()
    assert out.shape == (0, 4) and gate_up.grad.shape == (0, 8)


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(2, 7))
