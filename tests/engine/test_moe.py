from types import SimpleNamespace

import pytest
import torch

from conftest import relative_error
from pith_engine.moe import LoadBalance, Routing, attach_aux_loss, combine, dispatch, run_moe_layer, update_expert_bias


class ScaleExperts(torch.nn.Module):
    """A minimal five-stage layer (a pith_engine.contract.MoeLayer): expert e multiplies its tokens by (e + 1)."""
    is_moe, num_experts = True, 4
    experts = SimpleNamespace(local_experts=4, first_expert=0, ep_group=None, wgrad_pairs=None)   # all here

    def attention_stage(self, x):
        tokens = x.flatten(0, 1)
        expert_ids = torch.stack([tokens[:, 0].abs().mul(7).long() % 4, tokens[:, 1].abs().mul(5).long() % 4], 1)
        return x, tokens, Routing(expert_ids, torch.full(expert_ids.shape, 0.5))

    def expert_stage(self, x, tokens_per_expert):
        scale = torch.repeat_interleave(torch.arange(1.0, 5.0), tokens_per_expert)
        return x * scale[:, None]

    def aggregate_stage(self, hidden, tokens, routed):
        return hidden + routed.view_as(hidden)


def test_five_stages_in_order_equal_the_direct_computation():
    x = torch.randn(2, 5, 3)
    layer = ScaleExperts()
    _, tokens, routing = layer.attention_stage(x)
    direct = tokens + 0.5 * ((routing.expert_ids + 1).float().sum(1, keepdim=True) * tokens)
    assert relative_error(run_moe_layer(layer, x), direct.view_as(x)) < 1e-6


def test_dispatch_then_combine_returns_every_slot_to_its_token_weighted():
    tokens = torch.randn(6, 4)
    weights = torch.rand(6, 2)
    routing = Routing(torch.tensor([[0, 2], [2, 1], [1, 0], [3, 2], [0, 3], [2, 0]]), weights)
    expert_in, plan = dispatch(tokens, routing, num_experts=4)
    assert plan.tokens_per_expert.tolist() == [4, 2, 4, 2]
    assert relative_error(combine(expert_in, plan), tokens * weights.sum(1, keepdim=True)) < 1e-6


@pytest.mark.parametrize("mode", ["global_batch", "micro_batch"])
def test_switch_loss_is_top_k_when_balanced_and_counts_chosen_experts(mode):
    balance = LoadBalance(4, mode, coef=1.0, scale=4)
    probs = torch.full((8, 4), 0.25)
    expert_ids = torch.tensor([[0, 1], [2, 3]] * 4)
    # perfectly balanced: 4 * sum_e (4 / 8) * 0.25 = 2 = top_k
    assert 4 * balance.loss_share(probs, expert_ids, 1).item() == pytest.approx(2.0)
    skewed = torch.tensor([[0, 1]] * 8)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(8, -1)
    assert 4 * balance.loss_share(probs, skewed, 1).item() == pytest.approx(4 * (1 * 0.7 + 1 * 0.1))


def test_sequence_loss_averages_the_loss_of_each_sequence():
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 4 + [[0.25] * 4] * 4)
    expert_ids = torch.tensor([[0, 1]] * 4 + [[0, 1], [2, 3]] * 2)
    per_sequence = [(1 * 0.7 + 1 * 0.1), 0.5]   # sum_e f_e P_e of each 4-token sequence
    assert LoadBalance(4, "sequence", 1.0, 4).loss_share(probs, expert_ids, 2).item() == pytest.approx(
        sum(per_sequence) / 2)


def test_aux_free_bias_steers_the_choice_not_the_weights_and_moves_toward_balance():
    balance = LoadBalance(4, "aux_free", coef=1.0, scale=4, bias_rate=0.12)
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    expert_ids, weights = balance.select(scores, 2)
    assert expert_ids.tolist() == [[0, 1]] * 3 and torch.equal(weights, scores[:, :2])
    balance.attach_loss(scores, scores, expert_ids, 1)   # where a layer's routing is counted
    update_expert_bias(balance)   # loads 3, 3, 0, 0 around a mean of 1.5
    assert balance.expert_bias.tolist() == pytest.approx([-0.12, -0.12, 0.12, 0.12])
    assert balance.expert_load.sum().item() == 0
    expert_ids, weights = balance.select(scores, 2)   # biased scores 0.28, 0.18, 0.32, 0.22
    assert expert_ids.tolist() == [[2, 0]] * 3
    assert torch.equal(weights, torch.tensor([[0.2, 0.4]] * 3))
    hidden = torch.randn(2, 3)
    assert balance.attach_loss(hidden, scores, expert_ids, 1) is hidden   # aux_free attaches no loss


def test_attached_aux_loss_gets_gradient_one_and_leaves_the_value_unchanged():
    x = torch.randn(3, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    y = attach_aux_loss(x * 1.0, w * w)
    assert torch.equal(y, x)
    (y * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0)) and w.grad.item() == 4.0  # d(w^2)/dw = 2w
