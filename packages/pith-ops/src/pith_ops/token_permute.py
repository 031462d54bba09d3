"""Token permutation for MoE: sort (token, expert) slots by expert, gather tokens into expert-contiguous
order, and put expert outputs back in slot order.

A slot is one (token, k) pair of the router's top-k: slot s = token * top_k + k. Everything here stays
on the device; nothing waits for the host.
"""
import torch


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [tokens, top_k] -> (slot order sorted by expert [tokens * top_k], tokens_per_expert [E])."""
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


def gather_by_expert(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [tokens, hidden] -> [tokens * top_k, hidden], row i is the token of slot order[i]."""
    return x.index_select(0, order // top_k)


def scatter_to_slots(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of gather_by_expert's ordering: y [slots, hidden] in expert order -> slot order."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y.index_select(0, inverse)
