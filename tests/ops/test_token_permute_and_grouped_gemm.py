import pytest
import torch

from conftest import relative_error
from pith_ops.grouped_gemm import grouped_linear
from pith_ops.token_permute import gather_by_expert, scatter_to_slots, sort_by_expert


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 1, 4), (13, 2, 5), (64, 8, 16), (9, 3, 32)])
def test_permutation_groups_slots_by_expert_and_round_trips(tokens, top_k, experts):
    torch.manual_seed(tokens)
    expert_ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, 6)
    order, tokens_per_expert = sort_by_expert(expert_ids, experts)
    grouped = gather_by_expert(x, order, top_k)

    assert tokens_per_expert.tolist() == [(expert_ids == e).sum().item() for e in range(experts)]
    sorted_experts = expert_ids.flatten()[order]
    assert torch.equal(sorted_experts, torch.sort(sorted_experts).values)
    for row, slot in enumerate(order.tolist()):
        assert torch.equal(grouped[row], x[slot // top_k])
    back = scatter_to_slots(grouped, order).view(tokens, top_k, -1)
    assert torch.equal(back, x[:, None, :].expand(-1, top_k, -1))


def loop_reference(x, weight, tokens_per_expert):
    out, start = [], 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        out.append(x[start:start + n] @ weight[e].T)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[3, 0, 7], [0, 0, 1], [5], [1, 1, 1, 1], [0, 0, 0]])
def test_grouped_linear_matches_per_expert_matmul_forward_and_backward(counts):
    torch.manual_seed(0)
    tokens_per_expert = torch.tensor(counts)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    weight = torch.randn(len(counts), 24, 16, requires_grad=True)
    grad = torch.randn(sum(counts), 24)
    out = grouped_linear(x, weight, tokens_per_expert)
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    expected = loop_reference(x_ref, w_ref, tokens_per_expert)
    expected.backward(grad)
    # float32 matmuls of the same sizes: only summation order may differ
    assert out.shape == expected.shape
    if sum(counts):
        assert relative_error(out, expected) < 1e-6
        assert relative_error(x.grad, x_ref.grad) < 1e-6
        assert relative_error(weight.grad, w_ref.grad) < 1e-6
    assert torch.equal(weight.grad[tokens_per_expert == 0], torch.zeros_like(weight.grad[tokens_per_expert == 0]))
