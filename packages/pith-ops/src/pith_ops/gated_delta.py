"""The gated delta rule of Gated DeltaNet (Qwen3.5-MoE's linear-attention layers), per head, with a state S of
[d_k, d_v] carried along the sequence:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

g_t <= 0 is the log of the decay, beta_t in (0, 1) the write strength; q and k come normalized and scaled (the
model's job). `chunked_gated_delta` is the torch reference the CPU runs and autograd differentiates: within a
chunk of C tokens the u_t solve one unit lower-triangular system, so a chunk is a few matrix products instead
of C sequential steps. `recurrent_gated_delta` is the plain loop over tokens, the reference's own reference.
"""
import torch
import torch.nn.functional as F


def recurrent_gated_delta(q, k, v, g, beta, state=None):
    """q, k [batch, seq, heads, d_k], v [batch, seq, heads, d_v], g and beta [batch, seq, heads], state [batch,
    heads, d_k, d_v] (default zeros) -> (o [batch, seq, heads, d_v], the final state)."""
    batch, seq, heads, d_k = k.shape
    state = q.new_zeros(batch, heads, d_k, v.shape[-1]) if state is None else state
    outputs = []
    for t in range(seq):
        state = state * g[:, t, :, None, None].exp()
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, 1), state


def chunked_gated_delta(q, k, v, g, beta, state=None, chunk: int = 64):
    """recurrent_gated_delta's result, a chunk at a time. With G_i the cumulative log-decay from the chunk's start
    and S the state entering it: (I + A) U = beta (V - e^G K S), A_ij = beta_i e^(G_i - G_j) k_i.k_j for j < i;
    O = e^G Q S + (e^(G_i - G_j) q_i.k_j, j <= i) U; the state leaving it e^(G_C) S + (e^(G_C - G) K)^T U."""
    batch, seq, heads, d_k = k.shape
    pad = -seq % chunk   # padded tokens: no decay (g 0) and no write (beta 0) leave the state as it was
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))   # [batch, heads, seq, dim]
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))
    state = q.new_zeros(batch, heads, d_k, v.shape[-1]) if state is None else state
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    outputs = []
    for start in range(0, seq + pad, chunk):
        part = slice(start, start + chunk)
        qc, kc, vc, bc = q[:, :, part], k[:, :, part], v[:, :, part], beta[:, :, part, None]
        decay = g[:, :, part].cumsum(-1)
        # e^(G_i - G_j) below and on the diagonal only: above it the exponent is >= 0 and could overflow
        relative = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        lower = (bc * kc @ kc.transpose(-1, -2) * relative).tril(-1)
        eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
        target = bc * (vc - decay.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(eye + lower, target, upper=False, unitriangular=True)
        outputs.append(decay.exp()[..., None] * (qc @ state) + (qc @ kc.transpose(-1, -2) * relative) @ u)
        last = decay[..., -1:]
        state = last.exp()[..., None] * state + ((last - decay).exp()[..., None] * kc).transpose(-1, -2) @ u
    return torch.cat(outputs, 2)[:, :, :seq].transpose(1, 2), state
