"""An attention variant with its four tests, to copy as tests/apps/test_VARIANT.py; run as it is, it checks the example:
a learned per-head query temperature in Qwen3-MoE's attention (head h's queries times exp(t_h) before attention; t a
new parameter [heads], declared zeros and absent from Hugging Face files), written as a subclass here, so that nothing
ships in the package. The tests: (1) at t = 0 the variant is the unmodified model, logits and every gradient; (2) a
tiny case against a softmax written out here; (3) the app trains it (the loss falls, t moves from 0); (4) under
context parallelism (ring attention, 2 gloo processes) its loss and gradients are one process's."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

TESTS = Path(__file__).resolve().parents[3] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "apps")]   # standalone only: under tests/apps these are importable
from conftest import relative_error  # noqa: E402
from distributed import run_on_processes  # noqa: E402
import pith_apps.train as train_app  # noqa: E402
from pith_apps.config import read_json  # noqa: E402
from pith_apps.models.layers import apply_rotary, causal_attention, declare  # noqa: E402
from pith_apps.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from pith_apps.options import MODELS, PRESETS  # noqa: E402
from pith_engine.context_parallel import zigzag_part  # noqa: E402
from pith_engine.parallel import Parallel  # noqa: E402

CONFIG = Qwen3MoeConfig.from_dict(read_json(PRESETS / "qwen3_tiny.json") | {"initializer_range": 0.1})


class TemperedAttention(Qwen3MoeAttention):
    """Qwen3MoeAttention with each head's queries scaled by exp(temperature[h]) after the norm and rotary."""

    def __init__(self, cfg, parallel):
        super().__init__(cfg, parallel)
        self.temperature = nn.Parameter(torch.zeros(self.heads))
        declare(self, hf=False, temperature="zeros")   # starts as the unmodified attention; not in transformers' files

    def forward(self, x, cos, sin, docs=None):   # Qwen3MoeAttention.forward, and the line marked "variant"
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q = q * self.temperature.exp().to(q.dtype)[:, None, None]   # variant: [heads] over [batch, heads, seq, dim]
        out = causal_attention(q, k, v, self.head_dim ** -0.5, enable_gqa=True, docs=docs, ring=self.ring)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class TemperedQwen3(Qwen3MoeForCausalLM):
    """Qwen3-MoE whose layers attend with TemperedAttention; for the app: MODELS["qwen3"] = (Qwen3MoeConfig, this)."""

    def __init__(self, cfg, parallel=Parallel(), **options):
        super().__init__(cfg, parallel, **options)
        for layer in self.layers.values():
            layer.self_attn = TemperedAttention(cfg, parallel)


def batch(seq=32):
    ids = torch.randint(0, CONFIG.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def warmed(model):
    """model with every temperature away from 0 (head h: 0.3 (h - 1)), so that the variant shows."""
    with torch.no_grad():
        for layer in model.layers.values():
            layer.self_attn.temperature.copy_(0.3 * (torch.arange(CONFIG.num_attention_heads) - 1.0))
    return model


def test_at_zero_temperature_the_variant_is_the_unmodified_model():
    """The same seed gives both models the same weights (each drawn from its name); t = 0: the logits and every
    shared parameter's gradient within 1e-6 relative (exp(0) = 1: seen equal), and t has a gradient."""
    ours, theirs = TemperedQwen3(CONFIG), Qwen3MoeForCausalLM(CONFIG)
    ours.init_weights(seed=1)
    theirs.init_weights(seed=1)
    ids, labels = batch()
    assert relative_error(ours(ids).detach(), theirs(ids).detach()) < 1e-6
    ours.loss_sum(ids, labels).backward()
    theirs.loss_sum(ids, labels).backward()
    mine = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        assert relative_error(mine[name].grad, param.grad) < 1e-6, name
    assert all(layer.self_attn.temperature.grad.abs().min() > 0 for layer in ours.layers.values())


def test_a_tiny_case_is_the_softmax_written_out():
    """One layer's attention on 5 tokens (no rotation: cos 1, sin 0) against q, k, v, the norms, exp(t), the causal
    softmax and o_proj computed here: within 1e-6 relative; and t's values change the output by over 1%."""
    cfg = Qwen3MoeConfig.from_dict(read_json(PRESETS / "qwen3_tiny.json") | dict(hidden_size=8, head_dim=4,
                                                                                  num_attention_heads=2,
                                                                                  num_key_value_heads=1))
    attention = TemperedAttention(cfg, Parallel())
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in attention.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    x = torch.randn(1, 5, 8, generator=generator)
    cos, sin = torch.ones(5, 4), torch.zeros(5, 4)
    out = attention(x, cos, sin)

    def rms(t, weight):
        return t / (t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).sqrt() * weight
    p = dict(attention.named_parameters())
    k = rms(x[0] @ p["k_proj.weight"].T, p["k_norm.weight"])   # [5, 4]: the one key-value head
    v = x[0] @ p["v_proj.weight"].T
    heads = []
    for h in range(2):
        q = rms(x[0] @ p["q_proj.weight"][4 * h:4 * h + 4].T, p["q_norm.weight"]) * p["temperature"][h].exp()
        scores = (q @ k.T / 2).masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))   # 1 / sqrt(head_dim) = 1/2
        heads.append(torch.softmax(scores, dim=-1) @ v)
    expected = torch.cat(heads, dim=-1) @ p["o_proj.weight"].T
    assert relative_error(out[0].detach(), expected.detach()) < 1e-6
    with torch.no_grad():
        attention.temperature.zero_()
        assert relative_error(attention(x, cos, sin), out.detach()) > 1e-2


def test_the_app_trains_the_variant(tmp_path, monkeypatch):
    """pith_apps.train with the variant as the qwen3 family: 10 steps of the tiny preset on CPU, the loss falls by
    more than 1 (seen 5.49 -> 3.20); the exported folder holds every layer's temperature, each head's moved from 0."""
    monkeypatch.setitem(MODELS, "qwen3", (Qwen3MoeConfig, TemperedQwen3))
    losses = train_app.train(train_app.parse_args([
        "qwen3", "--steps", "10", "--batch-size", "4", "--seq-len", "32", "--warmup", "2", "--device", "cpu",
        "--quiet", "--save-every", "0", "--out", str(tmp_path / "run"), "--export-hf", str(tmp_path / "hf")]))
    assert losses[-1] < losses[0] - 1.0, losses
    tensors = {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        tensors |= load_file(file)
    temperatures = [tensors[f"model.layers.{n}.self_attn.temperature"] for n in range(CONFIG.num_hidden_layers)]
    assert all(t.abs().min() > 1e-4 for t in temperatures), temperatures


def context_parallel_body(rank, world):
    """cp 2: each rank its zigzag part of both sequences; the loss and every gradient, summed over the two ranks,
    within 1e-5 relative of one process's on the whole sequences (float32; summation order alone)."""
    reference, model = TemperedQwen3(CONFIG), TemperedQwen3(CONFIG, Parallel.build(cp=world))
    for each in (reference, model):
        each.init_weights(seed=3)   # the same weights on both: each tensor drawn from (seed, its name)
        warmed(each)
    ids, labels = batch()
    expected = reference.loss_sum(ids, labels) / labels.numel()
    expected.backward()
    loss = model.loss_sum(zigzag_part(ids, world, rank), zigzag_part(labels, world, rank)) / labels.numel()
    loss.backward()
    dist.all_reduce(loss := loss.detach())
    assert relative_error(loss, expected.detach()) < 1e-5, (loss, expected)
    wanted = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        assert relative_error(param.grad, wanted[name].grad) < 1e-5, name


def test_under_context_parallelism_the_variant_gives_the_whole_sequences_loss_and_gradients():
    run_on_processes(2, context_parallel_body)
