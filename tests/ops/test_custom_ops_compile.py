"""The kernels are custom ops with fake implementations: a torch.compile(fullgraph=True) graph that calls them
compiles without a break and computes what eager does (forward and backward)."""
import torch

from conftest import KERNEL_DEVICE, relative_error
from pith_ops.swiglu import swiglu
from pith_ops.token_permute import combine_tokens, dispatch_tokens, sort_by_expert


def dispatch_swiglu_combine(x, weights, order, inverse):
    expert_in = dispatch_tokens(x, order, inverse, 2, use_kernel=True)
    return combine_tokens(swiglu(expert_in, use_kernel=True), weights, order, inverse, 2, use_kernel=True)


def test_kernels_compile_in_one_graph_and_match_eager():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 32, generator=generator).to(KERNEL_DEVICE)
    weights = torch.rand(12, 2, generator=generator).to(KERNEL_DEVICE)
    order, inverse, _ = sort_by_expert(torch.randint(0, 4, (12, 2), generator=generator).to(KERNEL_DEVICE), 4)
    compiled = torch.compile(dispatch_swiglu_combine, fullgraph=True)
    results = []
    for fn in (dispatch_swiglu_combine, compiled):
        inputs = [t.clone().requires_grad_() for t in (x, weights)]
        out = fn(*inputs, order, inverse)
        out.square().sum().backward()
        results.append([out, *(t.grad for t in inputs)])
    for eager, graph in zip(*results):
        assert relative_error(graph, eager) < 1e-6   # the same kernels; float32
