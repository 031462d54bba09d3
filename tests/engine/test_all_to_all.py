import torch

from distributed import run_on_processes
from pith_engine.moe import all_to_all


def exchange_rows(rank, world):
    # rank r sends r + d + 1 rows to rank d, each row holding (sender, destination, index) as floats
    send_counts = [rank + d + 1 for d in range(world)]
    recv_counts = [s + rank + 1 for s in range(world)]
    x = torch.cat([torch.tensor([[rank, d, i] for i in range(rank + d + 1)], dtype=torch.float32)
                   for d in range(world)]).requires_grad_()
    out = all_to_all(x, send_counts, recv_counts)
    expected = torch.cat([torch.tensor([[s, rank, i] for i in range(s + rank + 1)], dtype=torch.float32)
                          for s in range(world)])
    assert torch.equal(out, expected)
    # backward: the gradient of each received row returns to its sender, at the row it was sent from
    weight = torch.arange(out.numel(), dtype=torch.float32).view_as(out) + 100 * rank
    (out * weight).sum().backward()
    for d in range(world):   # rank d's weight is known here: arange over its rows + 100 d
        start = sum(rank + e + 1 for e in range(d))
        rows_at_d = sum(s + d + 1 for s in range(rank))   # where our rows sit among d's received rows
        expected_grad = (torch.arange((rank + d + 1) * 3, dtype=torch.float32) + 3 * rows_at_d + 100 * d).view(-1, 3)
        assert torch.equal(x.grad[start:start + rank + d + 1], expected_grad)


def test_all_to_all_with_uneven_splits_exchanges_rows_and_returns_their_gradients():
    run_on_processes(3, exchange_rows)
