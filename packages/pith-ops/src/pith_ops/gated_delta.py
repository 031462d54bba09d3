"""The gated delta rule of Gated DeltaNet (Qwen3.5-MoE's linear-attention layers), per head, with a state S of
[d_k, d_v] carried along the sequence:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

g_t <= 0 is the log of the decay, beta_t in (0, 1) the write strength. A reset (`starts`, True where a token starts
a document) drops the state before its token: S_{t-1} = 0 there, exactly, whatever g_t. `gated_delta` is the rule as
the model calls it (q and k normalized here): on a GPU the chunked Triton kernels of the fla-core package when it is
installed (resets as the starts of its variable-length sequences), otherwise `chunked_gated_delta`, the torch
reference the CPU runs and autograd differentiates: within a chunk of C tokens the u_t solve one unit
lower-triangular system, so a chunk is a few matrix products instead of C sequential steps. `recurrent_gated_delta`
is the plain loop over tokens, the reference's own reference.
"""
import importlib.util
import warnings

import torch
import torch.nn.functional as F


def unit_length(x):
    """x / sqrt(|x|^2 + 1e-6) along the last dimension, as the released model (and fla's kernel) computes it; not
    F.normalize's x / max(|x|, eps), which differs by ~1e-6 / |x|^2."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


FAST_RULES = {}   # device type -> fla-core's chunk_gated_delta_rule, or None: the torch reference
SLOWER = "Gated DeltaNet's delta rule runs the torch reference on the GPU, ~60x slower (H200, seq 4096)"


def uses_fla(device_type: str) -> bool:
    """Whether gated_delta runs fla-core's kernels for tensors on device_type: on "cuda" when fla_missing() finds
    nothing in the way (else one warning saying what is), never elsewhere."""
    if device_type not in FAST_RULES:
        FAST_RULES[device_type] = None
        if device_type == "cuda":
            missing = fla_missing()
            if missing is not None:
                warnings.warn(f"{SLOWER}: {missing}")
                return False
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            FAST_RULES[device_type] = chunk_gated_delta_rule
    return FAST_RULES[device_type] is not None


def fla_missing() -> str | None:
    """None where fla-core's kernels can run on this machine's GPU, else why not and the fix, in one line (for an
    app to refuse with before any work, as uses_fla would warn at the first call)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as err:   # not installed, or an install that fails at import (its Triton, its einops)
        first = (str(err).strip().splitlines() or [""])[0]
        return f"fla-core is not importable ({type(err).__name__}: {first}); pip install fla-core"
    if fla_refuses_this_triton():
        import triton
        return (f"fla-core refuses Triton {triton.__version__} on Hopper GPUs (its issue 640: wrong gradients from one "
                "backward kernel before Triton 3.7.1); upgrade Triton to 3.7.1 or later (torch 2.12 or later), or pip "
                "install tilelang")
    return None


def fla_refuses_this_triton() -> bool:
    """fla-core 0.6 raises at the first backward on a Hopper GPU with Triton 3.4 to 3.7.0 unless its TileLang backend
    is installed: asked before any backward (fla_missing, at the rule's first call or an app's start), from the flags its
    check reads."""
    from fla.ops.common import chunk_o
    guarded = getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
    return bool(guarded and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
                and importlib.util.find_spec("tilelang") is None)


# torch.compile takes the answer as a constant: the mark torch.compiler.assume_constant_result sets, set without
# importing torch._dynamo, which importing the app does not load (tests/apps/test_import.py)
uses_fla._dynamo_marked_constant = True


def gated_delta(q, k, v, g, beta, state, scale: float, starts=None):
    """q, k [batch, seq, k_heads, d_k] before normalization, v [batch, seq, v_heads, d_v] with each key head serving
    v_heads / k_heads consecutive value heads, g and beta [batch, seq, v_heads], state [batch, v_heads, d_k, d_v]
    (None: zeros), starts [batch, seq] bool (None: no resets) -> (o in v's dtype, the final state). q and k are
    normalized to unit length and q scaled by scale. fla's kernels take q, k and v as they come (bf16 in training)
    and keep the state in fp32; the reference computes in fp32 (float64 for float64 inputs)."""
    if uses_fla(q.device.type):
        if starts is not None:
            return fla_over_documents(FAST_RULES[q.device.type], q, k, v, g, beta, state, scale, starts)
        return FAST_RULES[q.device.type](q, k, v, g, beta, scale=scale, initial_state=state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    wide = torch.promote_types(v.dtype, torch.float32)
    repeat = v.shape[2] // k.shape[2]
    q, k = (unit_length(t.to(wide)).repeat_interleave(repeat, dim=2) for t in (q, k))
    out, state = chunked_gated_delta(q * scale, k, v.to(wide), g.to(wide), beta.to(wide), state, starts)
    return out.to(v.dtype), state


def fla_over_documents(rule, q, k, v, g, beta, state, scale: float, starts):
    """gated_delta on fla's kernels with resets: the rows flattened into one sequence cut at every row's start and
    every reset, each piece a sequence of fla's variable-length call (cu_seqlens), which starts it from its own
    initial state; a row's first piece from the row's state (zeros where a reset opens the row, and no state
    tensor at all for a state of None, which fla would otherwise keep for its backward, one per piece), the others
    from zeros. A row's final state is its last piece's."""
    batch, seq = starts.shape
    opens = starts.clone()
    opens[:, 0] = True
    pieces = opens.sum(1)
    ends = pieces.cumsum(0)   # the number of pieces up to each row's end
    cu_seqlens = F.pad(opens.flatten().nonzero().flatten(), (0, 1), value=batch * seq)   # int64, as fla documents
    initial = None
    if state is not None:
        kept = torch.where(starts[:, 0, None, None, None], 0.0, state)
        initial = state.new_zeros(len(cu_seqlens) - 1, *state.shape[1:]).index_copy(0, ends - pieces, kept)
    flat = (t.reshape(1, batch * seq, *t.shape[2:]) for t in (q, k, v, g, beta))
    out, final = rule(*flat, scale=scale, initial_state=initial, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return out.view(batch, seq, *out.shape[2:]), final[ends - 1]


def gated_delta_from_unknown_state(q, k, v, g, beta, scale: float):
    """gated_delta over a chunk whose starting state S is not known yet (a context-parallel chunk). Its output and
    final state are affine in S: o_0 + Q S and B + A S, with o_0 and B from a zero state and Q and A from the
    identity with zero values; one call gives all four (values [v | 0] from the state [0 | I]). Returns
    ((o_0, Q), [B | A])."""
    batch, seq, heads, d_v = v.shape
    d_k = k.shape[-1]
    values = torch.cat([v, v.new_zeros(batch, seq, heads, d_k)], dim=-1)
    eye = torch.eye(d_k, dtype=g.dtype, device=g.device).expand(batch, heads, -1, -1)
    start = torch.cat([eye.new_zeros(batch, heads, d_k, d_v), eye], dim=-1)
    out, final = gated_delta(q, k, values, g, beta, start, scale)
    return out.split([d_v, d_k], dim=-1), final


def recurrent_gated_delta(q, k, v, g, beta, state=None, starts=None):
    """q, k [batch, seq, heads, d_k], v [batch, seq, heads, d_v], g and beta [batch, seq, heads], state [batch,
    heads, d_k, d_v] (default zeros), starts [batch, seq] bool (default None: no resets; the state is zeroed before
    each token marked True) -> (o [batch, seq, heads, d_v], the final state)."""
    batch, seq, heads, d_k = k.shape
    state = q.new_zeros(batch, heads, d_k, v.shape[-1]) if state is None else state
    decays = g.exp() if starts is None else g.exp().masked_fill(starts[..., None], 0.0)
    outputs = []
    for t in range(seq):
        state = state * decays[:, t, :, None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, 1), state


def chunked_gated_delta(q, k, v, g, beta, state=None, starts=None, chunk: int = 64):
    """recurrent_gated_delta's result, a chunk at a time. With G_i the cumulative log-decay from the chunk's start
    and S the state entering it: (I + A) U = beta (V - e^G K S), A_ij = beta_i e^(G_i - G_j) k_i.k_j for j < i;
    O = e^G Q S + (e^(G_i - G_j) q_i.k_j, j <= i) U; the state leaving it e^(G_C) S + (e^(G_C - G) K)^T U.
    Resets cut a chunk into segments, s_i the number of resets up to token i: token i reads token j's write only
    when s_i = s_j, the entering state only when s_i = 0; the leaving state takes token j's write only when
    s_j = s_C, the entering state only when s_C = 0. A reset's g is left out of G (it decays only the dropped
    state): a large negative g there would cost G the precision of its small terms."""
    batch, seq, heads, d_k = k.shape
    pad = -seq % chunk   # padded tokens: no decay (g 0), no write (beta 0), no reset leave the state as it was
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=q.device) if starts is None else starts
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))   # [batch, heads, seq, dim]
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g.masked_fill(starts[..., None], 0.0), beta))
    resets = F.pad(starts, (0, pad))[:, None].long()   # [batch, 1, seq], broadcast over heads
    state = q.new_zeros(batch, heads, d_k, v.shape[-1]) if state is None else state
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    outputs = []
    for start in range(0, seq + pad, chunk):
        part = slice(start, start + chunk)
        qc, kc, vc, bc = q[:, :, part], k[:, :, part], v[:, :, part], beta[:, :, part, None]
        decay, segment = g[:, :, part].cumsum(-1), resets[..., part].cumsum(-1)
        # e^(G_i - G_j) where token i reads token j's write: on and below the diagonal (above it the exponent is
        # >= 0 and could overflow) and within a segment (a reset between them dropped the write)
        same = causal & (segment[..., :, None] == segment[..., None, :])
        relative = (decay[..., :, None] - decay[..., None, :]).masked_fill(~same, float("-inf")).exp()
        entered = decay.masked_fill(segment != 0, float("-inf")).exp()[..., None]   # e^G_i where S reaches token i
        lower = (bc * kc @ kc.transpose(-1, -2) * relative).tril(-1)
        target = bc * (vc - entered * (kc @ state))
        u = torch.linalg.solve_triangular(eye + lower, target, upper=False, unitriangular=True)
        outputs.append(entered * (qc @ state) + (qc @ kc.transpose(-1, -2) * relative) @ u)
        kept = (decay[..., -1:] - decay).masked_fill(segment != segment[..., -1:], float("-inf")).exp()[..., None]
        state = entered[..., -1:, :] * state + (kept * kc).transpose(-1, -2) @ u
    return torch.cat(outputs, 2)[:, :, :seq].transpose(1, 2), state
