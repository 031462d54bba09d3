"""The tests of a routing variant, to copy as tests/apps/test_NAME.py; run as it is, it checks its example:
top-p routing on Qwen3-MoE (a token takes its highest-scoring experts, at most top_k, until their router
probabilities sum to P: some tokens get one expert, others top_k). The variant is a layer class here so that the
template runs without editing the package; in your change, write it in the family's attention_stage
(pith_apps/models/qwen3_moe.py) behind a config key or flag, and the tests call that instead of VariantModel.
The four tests: the limit where the variant is the default router, a case checked by hand, training through the
app, and the app under ep 2 and cp 2 against one process (float32: 1e-5)."""
import json
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parents[3] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "apps")]   # standalone only: under tests/apps these are importable
import conftest  # noqa: E402,F401  (Triton's CPU interpreter, set before pith_ops is imported)
import pith_apps.train as train_app  # noqa: E402
from distributed import run_on_processes  # noqa: E402
from pith_apps.models.layers import CausalLM, RMSNorm  # noqa: E402
from pith_apps.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM  # noqa: E402
from pith_apps.options import MODELS  # noqa: E402
from pith_engine.moe import Routing  # noqa: E402
from test_train import tensorboard_events  # noqa: E402

P = 0.16   # the variant's setting in the tests below: the tiny model's top probabilities are about 0.13-0.2


def top_p(expert_ids: torch.Tensor, chosen: torch.Tensor, p: float) -> torch.Tensor:
    """The variant: of each token's top_k experts (scores in descending order), those after the scores summed to p
    made absent (-1); the first is always kept."""
    before = torch.cumsum(chosen, -1) - chosen   # the probability of the experts ahead of each slot
    return torch.where(before < p, expert_ids, -1)


class VariantLayer(Qwen3MoeDecoderLayer):
    p = P

    def attention_stage(self, x, cos, sin, docs=None):
        """Qwen3MoeDecoderLayer.attention_stage with the variant between select and the aux loss, which, like the
        expert loads, then counts the slots kept."""
        hidden = x + self.self_attn(self.input_layernorm(x), cos, sin, docs)
        tokens = self.post_attention_layernorm(hidden).flatten(0, 1)
        probs = torch.softmax(self.mlp.gate(tokens).float(), dim=-1)
        expert_ids, weights = self.balance.select(probs, self.top_k)
        expert_ids = top_p(expert_ids, weights, self.p)
        if self.norm_topk_prob:   # over the experts kept
            weights = torch.where(expert_ids >= 0, weights, 0)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        hidden = self.balance.attach_loss(hidden, probs, expert_ids, x.shape[0])
        return hidden, tokens, Routing(expert_ids, weights.to(x.dtype))


class VariantModel(Qwen3MoeForCausalLM):
    def __init__(self, cfg, parallel=train_app.Parallel(), balance="global_batch", micro_batches=1, held_layers=None):
        CausalLM.__init__(self, cfg, lambda n: VariantLayer(cfg, parallel, balance, micro_batches),
                          RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), held_layers, parallel)


RUN = ["qwen3", "--batch-size", "4", "--seq-len", "32", "--steps", "6", "--warmup", "2", "--quiet", "--save-every",
       "0"]


def train(out, *flags, p=P):
    """The app's run with the variant as qwen3's model (setting p)."""
    with mock.patch.dict(MODELS, {"qwen3": (Qwen3MoeConfig, VariantModel)}), mock.patch.object(VariantLayer, "p", p):
        return train_app.train(train_app.parse_args([*RUN, "--out", str(out), *flags]))


def test_the_limit_is_the_default_router(tmp_path):
    """p = 1: every top_k slot kept (the experts after them have probability > 0), the default run's losses."""
    ours = train(tmp_path / "variant", p=1.0)
    default = train_app.train(train_app.parse_args([*RUN, "--out", str(tmp_path / "default")]))
    assert ours == default


def test_a_case_checked_by_hand():
    """Scores 0.5, 0.3, 0.1 of the top 3 at p = 0.7: 0.5 < 0.7 keeps the second, 0.8 drops the third; a token whose
    first is 0.7 keeps one expert; one of 0.3, 0.2, 0.15 keeps all three."""
    chosen = torch.tensor([[0.5, 0.3, 0.1], [0.7, 0.2, 0.05], [0.3, 0.2, 0.15]])
    expert_ids = torch.tensor([[4, 0, 2], [1, 3, 5], [7, 6, 0]])
    assert top_p(expert_ids, chosen, 0.7).tolist() == [[4, 0, -1], [1, -1, -1], [7, 6, 0]]


def test_it_trains_through_the_app_and_routes_one_to_top_k_experts(tmp_path):
    losses = train(tmp_path / "run")
    assert losses[-1] < losses[0] - 0.05
    per_token = [event.value for event in tensorboard_events(tmp_path / "run" / "tb").Scalars("train/experts_per_token")]
    assert all(1.0 < value < 2.0 for value in per_token), per_token   # qwen3_tiny: top 2


def parallel_runs(rank, world, root):
    losses = {f"{dim}2": train(root / f"{dim}2", f"--{dim}", "2") for dim in ("ep", "cp")}
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(losses))


def test_ep_2_and_cp_2_train_as_one_process(tmp_path):
    run_on_processes(2, parallel_runs, tmp_path)
    one = train(tmp_path / "one")
    for name, losses in json.loads((tmp_path / "losses.json").read_text()).items():
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, one)), (name, losses, one)
        assert dist.is_available() and len(losses) == len(one) == 6
