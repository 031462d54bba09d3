import types

import pytest
import torch

from conftest import relative_error
from pith_ops.swiglu import clamped_swiglu, clamped_swiglu_reference, swiglu, swiglu_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: the kernel and torch differ only by rounding in sigmoid/exp. bfloat16: both compute in fp32 and
# round once to bf16 (relative step 2**-8), so results may differ by one bf16 ulp per element.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3}
SHAPES = [(1, 2), (5, 2 * 96), (3, 4, 2 * 1500), (2, 2 * 1024)]


def kernel_and_reference(kernel, reference, gate_up, grad_out):
    """(out, grad) of the kernel in gate_up's dtype, and of the reference in float32."""
    kernel_in = gate_up.clone().requires_grad_()
    out = kernel(kernel_in, use_kernel=True)
    out.backward(grad_out)
    reference_in = gate_up.float().requires_grad_()
    expected = reference(reference_in)
    expected.backward(grad_out.float())
    assert out.dtype == gate_up.dtype and out.shape == expected.shape
    return (out, kernel_in.grad), (expected, reference_in.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_kernel_matches_reference_forward_and_backward(shape, dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    grad_out = torch.randn(*shape[:-1], shape[-1] // 2, device=DEVICE).to(dtype)
    (out, grad), (expected, expected_grad) = kernel_and_reference(swiglu, swiglu_reference, gate_up, grad_out)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert relative_error(grad, expected_grad) < TOLERANCE[dtype]


def clamp_test_input(shape, dtype):
    """std 6: about a quarter of the values of the non-zero rows lie beyond the clamp at 7; some sit
    exactly on +-7, where torch.clamp still passes the gradient; the last row is zero."""
    gate_up = torch.randn(shape, device=DEVICE) * 6
    gate_up.view(-1, shape[-1])[0, :4] = torch.tensor([7.0, 7.0, -7.0, -7.0])
    gate_up.view(-1, shape[-1])[-1] = 0.0
    return gate_up.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_clamped_swiglu_kernel_matches_reference_forward_and_backward(shape, dtype):
    torch.manual_seed(0)
    gate_up = clamp_test_input(shape, dtype)
    assert (gate_up.float().abs() > 7).float().mean() > 0.1
    grad_out = torch.randn(*shape[:-1], shape[-1] // 2, device=DEVICE).to(dtype)
    (out, grad), (expected, expected_grad) = kernel_and_reference(
        clamped_swiglu, clamped_swiglu_reference, gate_up, grad_out)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert relative_error(grad, expected_grad) < TOLERANCE[dtype]
    # clamped inputs get exactly zero gradient, in both
    gate, up = gate_up[..., 0::2].float(), gate_up[..., 1::2].float()
    assert (grad[..., 0::2][gate > 7] == 0).all() and (grad[..., 1::2][up.abs() > 7] == 0).all()


def test_clamped_swiglu_reference_matches_transformers_gpt_oss_experts():
    """transformers' GptOssExperts._apply_gate, forward and autograd backward, on values beyond the clamp."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    torch.manual_seed(1)
    gate_up = clamp_test_input((6, 2 * 40), torch.float32)
    grad_out = torch.randn(6, 40, device=DEVICE)
    theirs_in, ours_in = gate_up.clone().requires_grad_(), gate_up.clone().requires_grad_()
    experts = types.SimpleNamespace(alpha=1.702, limit=7.0)
    theirs = modeling.GptOssExperts._apply_gate(experts, theirs_in)
    theirs.backward(grad_out)
    ours = clamped_swiglu(ours_in, 1.702, 7.0, use_kernel=False)
    ours.backward(grad_out)
    # float32, the same formula: equal up to rounding
    assert relative_error(ours, theirs) < 1e-6 and relative_error(ours_in.grad, theirs_in.grad) < 1e-6


@pytest.mark.parametrize("entry", [swiglu, clamped_swiglu])
def test_no_rows_returns_empty(entry):
    gate_up = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    out = entry(gate_up, use_kernel=True)
    out.sum().backward()
    assert out.shape == (0, 4) and gate_up.grad.shape == (0, 8)


@pytest.mark.parametrize("entry", [swiglu, clamped_swiglu])
def test_odd_width_is_rejected(entry):
    with pytest.raises(ValueError, match="must be even"):
        entry(torch.randn(2, 7))
