import pytest
import torch

from conftest import KERNEL_DEVICE, relative_error
from pith_ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

# Loss: the reference on the same inputs (bf16 logits upcast to fp32, as in torch) within 1e-5.
# Gradients against an fp32 reference: float32 1e-5 (summation order); bfloat16 1e-2 (bf16 logits and
# gradients, each rounded to 2**-8 relative).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,chunk_size,vocab", [(1, 4, 101), (37, 8, 101), (64, 64, 5000), (50, 1024, 4096)])
def test_matches_reference_loss_and_gradients(tokens, chunk_size, vocab, dtype, use_kernel):
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 24, generator=generator).to(dtype)
    weight = (torch.randn(vocab, 24, generator=generator) * 0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::3] = -100   # ignored tokens, including the first

    device = KERNEL_DEVICE if use_kernel else "cpu"
    h, w = (t.to(device, copy=True).requires_grad_() for t in (hidden, weight))
    loss = linear_cross_entropy(h, w, labels.to(device), chunk_size=chunk_size, use_kernel=use_kernel)
    (loss * 0.37).backward()   # a scale, as the trainer's 1 / token count
    loss, grad_h, grad_w = loss.cpu(), h.grad.cpu(), w.grad.cpu()
    h_ref, w_ref = hidden.float().requires_grad_(), weight.float().requires_grad_()
    expected = linear_cross_entropy_reference(h_ref, w_ref, labels)
    (expected * 0.37).backward()

    same_inputs = linear_cross_entropy_reference(hidden, weight, labels)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - same_inputs.item()) <= 1e-5 * max(1.0, abs(same_inputs.item()))
    if (labels != -100).any():
        assert relative_error(grad_h, h_ref.grad) < TOLERANCE[dtype]
        assert relative_error(grad_w, w_ref.grad) < TOLERANCE[dtype]
    assert torch.all(grad_h[labels == -100] == 0)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
def test_a_weight_naming_its_master_adds_two_micro_batches_into_the_masters_grad(master_dtype, chunk_size):
    """The mixed-precision path (a bf16 copy naming its fp32 master) and the bf16 one (a parameter naming
    itself): the scaled gradient of each backward lands in the master's .grad, none in the copy's. 40 tokens:
    in 3 chunks (the first two's weight gradient summed in the forward and scaled into .grad, the last's added
    in the backward) and in one (only the backward's product, into a .grad that is not there yet, then into the
    first micro-batch's)."""
    generator = torch.Generator().manual_seed(0)
    master = (torch.randn(300, 16, generator=generator) * 0.5).to(KERNEL_DEVICE, master_dtype).requires_grad_()
    copy = master.detach().to(torch.bfloat16).requires_grad_()
    copy.grad_into = master
    hiddens = [torch.randn(40, 16, generator=generator).to(torch.bfloat16) for _ in range(2)]
    labels = [torch.randint(0, 300, (40,), generator=generator) for _ in range(2)]
    for hidden, label in zip(hiddens, labels):
        (linear_cross_entropy(hidden.to(KERNEL_DEVICE), copy, label.to(KERNEL_DEVICE), chunk_size=chunk_size,
                              use_kernel=True) * 0.25).backward()
    reference = master.detach().cpu().float().requires_grad_()
    for hidden, label in zip(hiddens, labels):
        (linear_cross_entropy_reference(hidden.float(), reference, label) * 0.25).backward()
    assert copy.grad is None and master.grad.dtype == master_dtype
    assert relative_error(master.grad.cpu().float(), reference.grad) < TOLERANCE[torch.bfloat16]


def test_only_hidden_needs_gradient():
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(30, 8)
    labels = torch.randint(0, 30, (10,))
    linear_cross_entropy(hidden, weight, labels, chunk_size=4).backward()
    h_ref = hidden.detach().clone().requires_grad_()
    linear_cross_entropy_reference(h_ref, weight, labels).backward()
    assert relative_error(hidden.grad, h_ref.grad) < 1e-5


def test_mismatched_labels_are_named():
    with pytest.raises(ValueError, match="3 hidden rows but 4 labels"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("bad", [30, 31, -1, -7])
def test_a_label_outside_the_vocabulary_is_named(bad, use_kernel):
    """The kernel would read past the logits row on the GPU; the call stops first and names the label."""
    device = KERNEL_DEVICE if use_kernel else "cpu"
    labels = torch.tensor([3, -100, 29, bad, 0], device=device)
    with pytest.raises(ValueError, match=rf"label {bad} at position 3 is outside the vocabulary 0\.\.29; valid "
                                         r"labels are those and ignore_index=-100"):
        linear_cross_entropy(torch.randn(5, 8, device=device), torch.randn(30, 8, device=device), labels,
                             use_kernel=use_kernel)
