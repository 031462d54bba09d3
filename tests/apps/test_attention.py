"""Our causal attention against the softmax written out, and the promise that it leaves SDPA's process-wide
settings (enabled backends, priority order) as it found them: torch chooses its backend order once per process,
and a context that saved and restored the order around that choice kept transformers off cuDNN for good."""
import pytest
import torch

from pith_apps.models.layers import causal_attention


def sdpa_settings():
    names = ("cudnn", "flash", "mem_efficient", "math", "overrideable")
    return [getattr(torch._C, f"_get_{name}_sdp_enabled")() for name in names], torch._C._get_sdp_priority_order()


@pytest.mark.parametrize("heads,kv_heads,qk_dim,v_dim", [(4, 2, 16, 16), (4, 4, 24, 16)])   # GQA; MLA's dims
def test_causal_attention_matches_the_written_out_softmax_and_touches_no_sdpa_setting(monkeypatch, heads, kv_heads,
                                                                                     qk_dim, v_dim):
    setters = []
    for name in [n for n in dir(torch._C) if n.startswith("_set_sdp_")]:
        original = getattr(torch._C, name)
        monkeypatch.setattr(torch._C, name, lambda *a, _name=name, _original=original: (setters.append(_name),
                                                                                           _original(*a))[1])
    before = sdpa_settings()
    torch.manual_seed(0)
    q = torch.randn(2, heads, 10, qk_dim, requires_grad=True)
    k = torch.randn(2, kv_heads, 10, qk_dim, requires_grad=True)
    v = torch.randn(2, kv_heads, 10, v_dim, requires_grad=True)
    out = causal_attention(q, k, v, qk_dim ** -0.5, enable_gqa=heads != kv_heads)
    out.square().sum().backward()
    assert setters == [] and sdpa_settings() == before
    repeat = heads // kv_heads
    scores = q @ k.repeat_interleave(repeat, 1).transpose(-1, -2) * qk_dim ** -0.5
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ v.repeat_interleave(repeat, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
