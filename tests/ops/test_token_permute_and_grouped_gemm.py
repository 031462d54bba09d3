import pytest
import torch

from conftest import KERNEL_DEVICE, relative_error
from pith_ops.grouped_gemm import deferred_linear, grouped_bias_add, grouped_linear, grouped_linear_reference
from pith_ops.token_permute import (_counting_sort, combine_tokens, dedup_by_rank, dispatch_tokens, ranks_of_tokens,
                                   sort_by_expert)


def random_routing(tokens, top_k, experts, seed):
    generator = torch.Generator().manual_seed(seed)
    # experts drawn from the first half only, so that some experts get no tokens
    pool = max(top_k, experts // 2)
    return torch.stack([torch.randperm(pool, generator=generator)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 1, 4), (13, 2, 5), (64, 8, 16), (9, 3, 32)])
def test_sort_by_expert_groups_slots_and_inverse_undoes_it(tokens, top_k, experts):
    expert_ids = random_routing(tokens, top_k, experts, seed=tokens)
    order, inverse, tokens_per_expert = sort_by_expert(expert_ids, experts)
    assert tokens_per_expert.tolist() == [(expert_ids == e).sum().item() for e in range(experts)]
    sorted_experts = expert_ids.flatten()[order]
    assert torch.equal(sorted_experts, torch.sort(sorted_experts).values)
    assert torch.equal(order[inverse], torch.arange(tokens * top_k))


@pytest.mark.parametrize("present", [4, None])   # None: every slot kept in order, the absent ones after the rest
@pytest.mark.parametrize("use_kernel", [False, True])
def test_sort_by_expert_leaves_absent_slots_out(use_kernel, present):
    expert_ids = torch.tensor([[1, -1], [-1, 0], [1, 0], [-1, -1]])
    device = KERNEL_DEVICE if use_kernel else "cpu"
    order, inverse, tokens_per_expert = sort_by_expert(expert_ids.to(device), 2, present=present, use_kernel=use_kernel)
    assert order.tolist() == [3, 5, 0, 4] + ([] if present else [1, 2, 6, 7])
    assert inverse.tolist() == [2, -1, -1, 0, 3, 1, -1, -1]
    assert tokens_per_expert.tolist() == [2, 2]


@pytest.mark.parametrize("tokens,top_k,experts,absent", [(300, 8, 128, False), (333, 6, 64, True)])
def test_the_counting_sort_kernels_give_the_stable_argsorts_order(tokens, top_k, experts, absent):
    """Blocks of 64 slots (1024 on the GPU), so that a slot's place depends on the blocks before it (38 of them
    at the first shape: more than the 32 rows of counts the kernel sums at a time)."""
    generator = torch.Generator().manual_seed(tokens)
    expert_ids = torch.randint(0, experts, (tokens, top_k), generator=generator)
    if absent:
        expert_ids[torch.rand(expert_ids.shape, generator=generator) < 0.3] = -1
    expected = sort_by_expert(expert_ids, experts, use_kernel=False)
    got = _counting_sort(expert_ids.to(KERNEL_DEVICE).flatten(), experts, block=64)
    for name, a, b in zip(("order", "inverse", "tokens_per_expert"), got, expected):
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("weighted", [True, False])   # False: constant weights, no rows kept for their gradient
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,experts,hidden,absent", [(1, 1, 4, 16, None), (13, 2, 5, 40, None),
                                                                 (33, 8, 16, 24, None), (7, 8, 8, 130, None),
                                                                 (13, 2, 5, 40, "cut"), (33, 8, 16, 24, "cut"),
                                                                 (13, 2, 5, 40, "kept"), (33, 8, 16, 24, "kept")])
def test_dispatch_and_combine_kernels_match_references_forward_and_backward(tokens, top_k, experts, hidden, absent,
                                                                            dtype, weighted):
    """absent: slots marked -1, as on an expert-parallel receiver (slots whose expert lives elsewhere) or from a
    router that picks fewer than top_k; "cut": order stops at the present slots; "kept": order keeps every slot
    (the fixed size of one process), the expert rows past the present ones NaN, which nothing may read."""
    expert_ids = random_routing(tokens, top_k, experts, seed=tokens)
    if absent:
        expert_ids[torch.rand(expert_ids.shape, generator=torch.Generator().manual_seed(1)) < 0.4] = -1
    present = int((expert_ids >= 0).sum())
    order, inverse, _ = sort_by_expert(expert_ids, experts, present if absent == "cut" else None)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weights = torch.rand(tokens, top_k, generator=generator).to(dtype)
    grad = torch.randn(tokens, hidden, generator=generator).to(dtype)

    def run(use_kernel):
        device = KERNEL_DEVICE if use_kernel else "cpu"
        x_, w_ = x.to(device).requires_grad_(), weights.to(device).requires_grad_(weighted)
        o, i = order.to(device), inverse.to(device)
        expert_out = dispatch_tokens(x_, o, i, top_k, use_kernel) * 1.5   # a stand-in expert
        expert_out = torch.where(torch.arange(o.numel(), device=device)[:, None] < present, expert_out, float("nan"))
        out = combine_tokens(expert_out, w_, o, i, top_k, use_kernel)
        out.backward(grad.to(device))
        return [t.cpu() for t in (expert_out, out, x_.grad, w_.grad if weighted else torch.zeros(1))]
    # dispatch is a copy (exact); combine sums top_k products in fp32 and rounds once to the dtype
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    results = run(True)
    for got, expected in zip(results[1:], run(False)[1:]):
        assert got.dtype == expected.dtype and relative_error(got, expected) < tolerance
    # against the sum written out: each token's present slots only
    kept = torch.where(expert_ids >= 0, weights.float(), 0)
    assert relative_error(results[1], (1.5 * x.float() * kept.sum(1, keepdim=True)).to(dtype)) < tolerance
    if absent and weighted:   # an absent slot contributes nothing and its weight gets no gradient
        assert torch.all(results[3][expert_ids < 0] == 0)


def test_dedup_by_rank_sends_each_token_once_per_destination_rank():
    # 8 experts on 4 ranks (2 per rank); token 0 has both its experts on rank 1
    expert_ids = torch.tensor([[2, 3], [0, 7], [5, 4], [1, 6]])
    goes_to = ranks_of_tokens(expert_ids, experts_per_rank=2, num_ranks=4)
    assert goes_to.sum(0).tolist() == [2, 1, 1, 2]   # pairs per rank
    pair_token, pair_rank, local = dedup_by_rank(expert_ids, 2, goes_to, pairs=6)
    assert pair_rank.tolist() == [0, 0, 1, 2, 3, 3]
    assert pair_token.tolist() == [1, 3, 0, 2, 1, 3]
    assert local.tolist() == [[0, -1], [1, -1], [0, 1], [1, 0], [-1, 1], [-1, 0]]
    # (token, destination rank) pairs, not (token, expert) pairs: 6 rows sent instead of 8
    assert len(pair_token) == len({(t, r) for t, row in enumerate(expert_ids.tolist()) for r in (row[0] // 2, row[1] // 2)})


def test_dedup_by_rank_orders_pairs_as_nonzero_does_without_counting_them():
    """The pairs in nonzero's order (rank, then token), from the count the caller passes instead of nonzero's own,
    which on CUDA waits for the host: 64 tokens, top 4 of 16 experts on 4 ranks."""
    generator = torch.Generator().manual_seed(2)
    expert_ids = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(64)])
    goes_to = ranks_of_tokens(expert_ids, experts_per_rank=4, num_ranks=4)
    pair_token, pair_rank, _ = dedup_by_rank(expert_ids, 4, goes_to, pairs=int(goes_to.sum()))
    assert torch.equal(torch.stack([pair_rank, pair_token], 1), goes_to.T.nonzero())


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 70], [0, 0, 1], [5], [1, 1, 1, 1], [0, 0, 0], [65, 0, 0, 130]])
def test_grouped_linear_matches_per_expert_matmul_forward_and_backward(counts, use_triton):
    torch.manual_seed(0)
    device = KERNEL_DEVICE if use_triton else "cpu"
    tokens_per_expert = torch.tensor(counts)
    x = torch.randn(sum(counts), 24, device=device, requires_grad=True)
    weight = torch.randn(len(counts), 40, 24, device=device, requires_grad=True)
    grad = torch.randn(sum(counts), 40, device=device)
    out = grouped_linear(x, weight, tokens_per_expert.to(device), use_triton=use_triton)
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    expected = grouped_linear_reference(x_ref, w_ref, tokens_per_expert)
    # float32 matmuls of the same sizes: only summation order may differ
    assert out.shape == (sum(counts), 40)
    if sum(counts):
        expected.backward(grad)
        assert relative_error(out, expected) < 1e-6
        assert relative_error(x.grad, x_ref.grad) < 1e-6
        assert relative_error(weight.grad, w_ref.grad) < 1e-6
    idle = (tokens_per_expert == 0).to(device)
    assert torch.equal(weight.grad[idle], torch.zeros_like(weight.grad[idle]))


@pytest.mark.parametrize("use_triton", [False, True])
def test_deferred_weight_gradient_waits_in_the_queue_then_accumulates(use_triton):
    torch.manual_seed(1)
    device = KERNEL_DEVICE if use_triton else "cpu"
    tokens_per_expert = torch.tensor([4, 0, 9], device=device)
    x = torch.randn(13, 16, device=device, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, 32, 16, device=device))
    queue = []
    out = grouped_linear(x, weight, tokens_per_expert, wgrad_queue=queue, use_triton=use_triton)
    out.square().sum().backward()
    assert weight.grad is None and len(queue) == 1 and x.grad is not None
    queue.pop()()
    w_ref = weight.detach().clone().requires_grad_()
    grouped_linear_reference(x.detach(), w_ref, tokens_per_expert).square().sum().backward()
    assert relative_error(weight.grad, w_ref.grad) < 1e-6


@pytest.mark.parametrize("copy", [False, True])
def test_a_deferred_dense_linear_leaves_its_weight_and_bias_gradients_to_the_queue(copy):
    """F.linear's gradients, the weight's and the bias's only once the queued closure runs (twice: they add up);
    copy: the layer computes with bf16 copies naming their fp32 parameters (grad_into), as under ComputeCasts."""
    torch.manual_seed(3)
    x = torch.randn(2, 5, 16, requires_grad=True)
    weight, bias = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(8))
    used = [weight, bias]
    if copy:
        used = [p.detach().bfloat16().requires_grad_() for p in (weight, bias)]
        for p, master in zip(used, (weight, bias)):
            p.grad_into = master
    queue = []
    for _ in range(2):
        deferred_linear(x.to(used[0].dtype), *used, queue).float().square().sum().backward()
    assert weight.grad is None and bias.grad is None and len(queue) == 2 and x.grad is not None
    for closure in queue:
        closure()
    reference = [t.detach().to(used[0].dtype).requires_grad_() for t in (x, *used)]
    torch.nn.functional.linear(*reference).float().square().sum().backward()
    for got, wanted in [(x.grad / 2, reference[0].grad), (weight.grad / 2, reference[1].grad),
                        (bias.grad / 2, reference[2].grad)]:
        assert got.dtype == torch.float32 and relative_error(got, wanted.float()) < 1e-6   # the same products


def test_grouped_linear_bfloat16_triton_matches_fp32_reference():
    torch.manual_seed(2)
    tokens_per_expert = torch.tensor([17, 0, 33, 1])
    x = torch.randn(51, 32).bfloat16()
    weight = torch.randn(4, 48, 32).bfloat16()
    out = grouped_linear(x.to(KERNEL_DEVICE), weight.to(KERNEL_DEVICE), tokens_per_expert.to(KERNEL_DEVICE),
                         use_triton=True).cpu()
    expected = grouped_linear_reference(x.float(), weight.float(), tokens_per_expert)
    # bf16 inputs are exact in fp32; the kernel accumulates in fp32 and rounds once to bf16 (2**-8)
    assert out.dtype == torch.bfloat16 and relative_error(out, expected) < 4e-3


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 70], [0, 1], [40, 0, 0, 0, 5]])
def test_grouped_bias_add_forward_and_bias_gradient(counts, use_kernel):
    torch.manual_seed(3)
    device = KERNEL_DEVICE if use_kernel else "cpu"
    tokens_per_expert = torch.tensor(counts, device=device)
    x = torch.randn(sum(counts), 150, device=device, requires_grad=True)
    bias = torch.randn(len(counts), 150, device=device, requires_grad=True)
    grad = torch.randn(sum(counts), 150, device=device)
    grouped_bias_add(x, bias, tokens_per_expert, use_kernel).backward(grad)
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=device), tokens_per_expert)
    expected_bias_grad = torch.zeros(len(counts), 150, device=device).index_add_(0, expert_of_row, grad)
    assert torch.equal(x.grad, grad)
    assert relative_error(bias.grad, expected_bias_grad) < 1e-6   # fp32 sums in another order
    out = grouped_bias_add(x.detach(), bias.detach(), tokens_per_expert, use_kernel)
    assert torch.equal(out, x.detach() + bias.detach()[expert_of_row])
