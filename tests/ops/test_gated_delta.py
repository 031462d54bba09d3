"""The gated delta rule's chunked torch reference against the plain loop over tokens, and against transformers';
fla-core's GPU kernels (the model's path on a GPU) against the reference; the warning when fla-core is missing."""
import importlib.util
import re
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import relative_error
from pith_ops import gated_delta as rule
from pith_ops.gated_delta import (chunked_gated_delta, gated_delta, gated_delta_from_unknown_state, recurrent_gated_delta,
                                  unit_length)


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


def starts_at(resets, seq: int, device=None):
    """[rows, seq] bool, True at each row's reset tokens (resets: one tuple of token numbers per row)."""
    starts = torch.zeros(len(resets), seq, dtype=torch.bool, device=device)
    for row, tokens in enumerate(resets):
        starts[row, list(tokens)] = True
    return starts


def each_document_alone(q, k, v, g, beta, state, resets):
    """recurrent_gated_delta over each document of each row by itself: from a zero state, but a row's first
    document from the row's state where no reset opens the row; -> (outputs, each row's last document's state)."""
    outputs, finals = [], []
    for row, tokens in enumerate(resets):
        bounds = sorted({0, *tokens, q.shape[1]})
        pieces = [[t[row:row + 1, start:end] for t in (q, k, v, g, beta)] for start, end in zip(bounds, bounds[1:])]
        runs = [recurrent_gated_delta(*piece, None if start or 0 in tokens else state[row:row + 1])
                for piece, start in zip(pieces, bounds)]
        outputs.append(torch.cat([out for out, _ in runs], 1))
        finals.append(runs[-1][1])
    return torch.cat(outputs), torch.cat(finals)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_resets_give_each_document_as_it_runs_alone_and_its_gradients(chunked, dtype, tolerance):
    """Resets (starts) at token 0 (the row's state dropped), on chunk boundaries (32, 64, 96), twice in a row (40
    and 41; 64 and 65), mid-chunk and at the last token, the other row keeping its state: the chunked rule (chunks
    of 32, the last padded) and the loop give each document's output, each row's final state and the gradients of
    all six inputs that each document run alone gives; the dropped state's gradient is 0. Chunked, seen 1.1e-15 in
    float64 and 4.4e-7 in float32 (the loop: equal); a log-decay of -80 at the resets instead gave 3.3e-6."""
    resets = [(0, 32, 40, 41, 100), (64, 65, 96, 149)]
    leaves = [t.requires_grad_() for t in delta_inputs(dtype)]
    starts = starts_at(resets, 150)
    ours = chunked_gated_delta(*leaves, starts, chunk=32) if chunked else recurrent_gated_delta(*leaves, starts)
    alone = each_document_alone(*leaves, resets)
    weights = [torch.randn_like(t) for t in alone]
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, weights)), leaves) for out in (ours, alone)]
    assert not grads[0][5][0].any()   # the state a reset at token 0 drops has no gradient
    for mine, reference in [*zip(ours, alone), *zip(*grads)]:
        assert relative_error(mine, reference) < tolerance


def varlen_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """fla's chunk_gated_delta_rule with cu_seqlens as fla documents it (one row; sequence n is tokens
    cu_seqlens[n] to cu_seqlens[n + 1], from initial_state[n], default zeros), computed by the torch reference."""
    assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int64 and output_final_state and use_qk_l2norm_in_kernel
    bounds = cu_seqlens.tolist()
    runs = [gated_delta(*(t[:, start:end] for t in (q, k, v, g, beta)),
                        None if initial_state is None else initial_state[n:n + 1], scale)
            for n, (start, end) in enumerate(zip(bounds, bounds[1:]))]
    return torch.cat([out for out, _ in runs], 1), torch.cat([final for _, final in runs])


@pytest.mark.parametrize("initial", [True, False])
def test_resets_reach_fla_as_its_variable_length_sequences(initial):
    """gated_delta's path to fla's kernels with resets (fla_over_documents), on a stand-in for the kernels that
    keeps fla's contract for cu_seqlens: the output, final state and gradients of the reference with the same
    resets, also of a row opened by a reset (its state dropped) and without a state (float64, exact to rounding)."""
    resets = [(0, 64, 65, 100), (32, 149)]
    q, k = (torch.randn(2, 150, 2, 16, dtype=torch.float64) for _ in range(2))
    leaves = [t.requires_grad_() for t in [q, k, *delta_inputs(torch.float64, heads=4)[2:]]][:6 if initial else 5]
    state, starts = leaves[5] if initial else None, starts_at(resets, 150)
    fast = rule.fla_over_documents(varlen_rule, *leaves[:5], state, 0.3, starts)
    reference = gated_delta(*leaves[:5], state, 0.3, starts)
    weights = [torch.randn_like(t) for t in reference]
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, weights)), leaves) for out in (fast, reference)]
    for ours, expected in [*zip(fast, reference), *zip(*grads)]:
        assert relative_error(ours, expected) < 1e-12


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="transformers calls fla-core's kernels "
                    "where it is installed; this compares its torch path")
def test_the_chunked_rule_is_transformers_torch_path():
    """transformers' torch_chunk_gated_delta_rule (Qwen3.5-MoE), given the unscaled queries it scales itself and
    chunks of 64: the same outputs and final state in float32 (seen 1.2e-7)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule
    q, k, v, g, beta, state = delta_inputs(torch.float32, seq=200)
    theirs, their_state = torch_chunk_gated_delta_rule(q * 16 ** 0.5, k, v, g, beta, initial_state=state,
                                                       output_final_state=True)
    ours, our_state = chunked_gated_delta(q, k, v, g, beta, state)
    assert relative_error(ours, theirs) < 1e-5 and relative_error(our_state, their_state) < 1e-5


def test_a_missing_fla_warns_once_for_the_gpu_and_never_for_the_cpu(monkeypatch):
    """Without an importable fla-core a CUDA tensor gets the reference (None here) and one warning naming the
    package; a CPU tensor gets the reference silently."""
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)   # importing it now raises ImportError
    monkeypatch.setattr(rule, "FAST_RULES", {})
    with pytest.warns(UserWarning, match="fla-core is not importable.*pip install fla-core"):
        assert not rule.uses_fla("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not rule.uses_fla("cuda") and not rule.uses_fla("cpu")


@pytest.mark.parametrize("fixed_triton", [False, True])
def test_fla_refusing_this_triton_on_hopper_is_found_at_the_first_call(monkeypatch, fixed_triton):
    """fla-core 0.6's guard (Hopper, Triton 3.4 to 3.7.0, no TileLang: it raises at the first backward) read from
    its flags at the first call: the reference and one warning naming the fix; with Triton 3.7.1, fla's kernels."""
    chunk_o = types.SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=fixed_triton)
    kernels = types.SimpleNamespace(chunk_gated_delta_rule=lambda *args, **kwargs: None)
    for name, module in [("fla", types.SimpleNamespace()), ("fla.ops", types.SimpleNamespace()),
                         ("fla.ops.common", types.SimpleNamespace(chunk_o=chunk_o)), ("fla.ops.common.chunk_o", chunk_o),
                         ("fla.ops.gated_delta_rule", kernels)]:
        monkeypatch.setitem(sys.modules, name, module)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "tilelang" else find_spec(name, *rest))
    monkeypatch.setattr(rule, "FAST_RULES", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert rule.uses_fla("cuda") == fixed_triton
    messages = [str(w.message) for w in seen if "fla-core" in str(w.message)]
    assert len(messages) == (0 if fixed_triton else 1)
    assert all(re.search(r"refuses Triton [0-9.]+ on Hopper.*3\.7\.1.*pip install tilelang", m) for m in messages)
    assert rule.FAST_RULES["cuda"] is (kernels.chunk_gated_delta_rule if fixed_triton else None)


def test_the_models_call_normalizes_repeats_key_heads_and_scales():
    """gated_delta's reference path: q and k to unit length, each key head given to two consecutive value heads, q
    scaled; the same as the chunked rule on inputs prepared by hand (float64, exact to rounding)."""
    q, k = (torch.randn(2, 70, 2, 16, dtype=torch.float64) for _ in range(2))
    v, g, beta, state = delta_inputs(torch.float64, seq=70, heads=4)[2:]
    ours, our_state = gated_delta(q, k, v, g, beta, state, scale=0.3)
    by_hand = [unit_length(t).repeat_interleave(2, dim=2) for t in (q, k)]
    reference, reference_state = chunked_gated_delta(by_hand[0] * 0.3, by_hand[1], v, g, beta, state)
    assert relative_error(ours, reference) < 1e-12 and relative_error(our_state, reference_state) < 1e-12


def test_from_an_unknown_state_the_output_and_final_state_are_its_affine_maps():
    """gated_delta_from_unknown_state's ((o_0, Q), [B | A]) applied to a state S: o_0 + Q S and B + A S are the
    rule's output and final state from S (float64, exact to rounding; d_k != d_v, two value heads per key head)."""
    q, k = (torch.randn(2, 70, 2, 16, dtype=torch.float64) for _ in range(2))
    v, g, beta, state = delta_inputs(torch.float64, seq=70, heads=4)[2:]
    (zeroed, seen), final = gated_delta_from_unknown_state(q, k, v, g, beta, scale=0.3)
    offset, transition = final.split([v.shape[-1], k.shape[-1]], dim=-1)
    out, out_state = gated_delta(q, k, v, g, beta, state, scale=0.3)
    assert relative_error(zeroed + torch.einsum("bshk,bhkv->bshv", seen, state), out) < 1e-12
    assert relative_error(offset + transition @ state, out_state) < 1e-12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's Triton kernels run on CUDA (the device machine)")
@pytest.mark.parametrize("resets", [None, [(0, 130, 140, 600), (64, 65, 999)]])
@pytest.mark.parametrize("initial", [True, False])
def test_fla_kernels_compute_the_reference_rule_and_its_gradients(monkeypatch, resets, initial):
    """Qwen3.5-35B's head layout (16 key heads, 32 value heads, 128 x 128), 2 rows of 1000 tokens, bf16 q, k, v as
    training feeds them, fp32 decay, write strength and state (initial False: none, zeros): fla-core's output, final
    state and the gradients of all inputs against the fp32 reference on the same bf16 values, relative error under
    2e-2 (bf16's rounding of the kernels' intermediates). With resets (--doc-mask's document starts, fla's
    variable-length sequences): row 0's at token 0 (its state dropped), two in one 64-token chunk and one more; row
    1's on a chunk boundary, the token after it and the last token, its first document from its state. fla-core
    refuses Triton 3.4-3.7.0 on Hopper (its issue 640: a miscompile at 64-wide key blocks; 128-dim keys take 128-wide
    blocks there): lifted here, so this checks the kernels at the model's shape on whatever Triton the machine has."""
    chunk_o = pytest.importorskip("fla.ops.common.chunk_o")
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", True, raising=False)
    monkeypatch.setattr(rule, "FAST_RULES", {})
    generator = torch.Generator(device="cuda").manual_seed(0)
    draw = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=generator, device="cuda").to(dtype)   # noqa: E731
    q, k, v = draw(2, 1000, 16, 128, dtype=torch.bfloat16), draw(2, 1000, 16, 128, dtype=torch.bfloat16), \
        draw(2, 1000, 32, 128, dtype=torch.bfloat16)
    g, beta, state = -F.softplus(draw(2, 1000, 32)) * 0.5, draw(2, 1000, 32).sigmoid(), draw(2, 32, 128, 128)
    starts = None if resets is None else starts_at(resets, 1000, "cuda")
    weights = draw(2, 1000, 32, 128), draw(2, 32, 128, 128)
    assert rule.uses_fla("cuda")
    results = []
    for fast in (rule.FAST_RULES["cuda"], None):   # None: the reference, on the same values in fp32
        monkeypatch.setitem(rule.FAST_RULES, "cuda", fast)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, state)][:6 if initial else 5]
        inputs = leaves[:3] if fast else [t.float() for t in leaves[:3]]
        out, final = gated_delta(*inputs, *leaves[3:5], leaves[5] if initial else None, 128 ** -0.5, starts)
        ((out.float() * weights[0]).sum() + (final * weights[1]).sum()).backward()
        results.append([out, final, *(t.grad for t in leaves)])
    for ours, reference in zip(*results):
        assert relative_error(ours, reference) < 2e-2
