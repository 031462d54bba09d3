"""The gated delta rule's chunked torch reference against the plain loop over tokens, and against transformers'."""
import pytest
import torch
import torch.nn.functional as F

from conftest import relative_error
from pith_ops.gated_delta import chunked_gated_delta, recurrent_gated_delta


def delta_inputs(dtype, batch=2, seq=150, heads=3, d_k=16, d_v=24, seed=0):
    """Unit-norm keys, queries scaled by 1/sqrt(d_k), decays exp(g) in (0.5, 1), write strengths in (0.5, 0.73),
    a random initial state: as Gated DeltaNet feeds the rule."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype)   # noqa: E731
    q = F.normalize(draw(batch, seq, heads, d_k), dim=-1) * d_k ** -0.5
    k = F.normalize(draw(batch, seq, heads, d_k), dim=-1)
    g = -F.softplus(draw(batch, seq, heads)) * 0.5
    beta = torch.rand(batch, seq, heads, generator=generator, dtype=dtype).sigmoid()
    return [q, k, draw(batch, seq, heads, d_v), g, beta, draw(batch, heads, d_k, d_v)]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_chunks_compute_the_token_by_token_recurrence_and_its_gradients(dtype, tolerance):
    """150 tokens in chunks of 32 (the last one padded): outputs, final state and the gradients of all six inputs
    (initial state included) equal the loop's; seen 5e-16 in float64, 5e-7 in float32."""
    leaves = [t.requires_grad_() for t in delta_inputs(dtype)]
    looped, chunked = recurrent_gated_delta(*leaves), chunked_gated_delta(*leaves, chunk=32)
    weights = [torch.randn_like(t) for t in looped]
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, weights)), leaves) for out in (looped, chunked)]
    for ours, reference in [*zip(chunked, looped), *zip(*reversed(grads))]:
        assert relative_error(ours, reference) < tolerance


def test_the_chunked_rule_is_transformers_torch_path():
    """transformers' torch_chunk_gated_delta_rule (Qwen3.5-MoE), given the unscaled queries it scales itself and
    chunks of 64: the same outputs and final state in float32 (seen 1.2e-7)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule
    q, k, v, g, beta, state = delta_inputs(torch.float32, seq=200)
    theirs, their_state = torch_chunk_gated_delta_rule(q * 16 ** 0.5, k, v, g, beta, initial_state=state,
                                                       output_final_state=True)
    ours, our_state = chunked_gated_delta(q, k, v, g, beta, state)
    assert relative_error(ours, theirs) < 1e-5 and relative_error(our_state, their_state) < 1e-5
