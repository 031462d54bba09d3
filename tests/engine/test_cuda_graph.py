"""StepGraph: a step captured as a CUDA graph and replayed gives what the same steps give eagerly. CUDA graphs
need a GPU: these run on the device machine (bench/RESULTS.md records the run), not on a CPU-only CI."""
import pytest
import torch

from pith_engine.cuda_graph import StepGraph
from pith_engine.data_parallel import grad_norm
from pith_engine.optim import adamw, clipped_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the device machine)")


def test_replayed_steps_follow_the_inputs_and_the_lr_they_are_given_as_the_eager_steps_do():
    """Six steps of a small MLP with AdamW, the clip and a learning rate that changes every step: eagerly, and
    through a StepGraph (two eager calls, a capture, replays). Same kernels on the same data: within 1e-6."""
    def run(graphed: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
        optimizer = adamw(model, 1.0, 0.1)

        def step(x, y, lr):
            loss = torch.zeros((), device="cuda")
            for rows in (slice(0, 4), slice(4, 8)):   # two micro-batches, gradients accumulated
                micro = (model(x[rows]) - y[rows]).square().mean() / 2
                micro.backward()
                loss += micro.detach()
            norm = grad_norm(model.parameters())
            clipped_step(optimizer, norm, 0.5, lr)
            optimizer.zero_grad(set_to_none=True)
            return loss, norm
        runner = StepGraph(step) if graphed else step
        generator = torch.Generator().manual_seed(1)
        losses = []
        for number in range(6):
            x, y = torch.randn(8, 32, generator=generator).cuda(), torch.randn(8, 8, generator=generator).cuda()
            loss, norm = runner(x, y, torch.tensor(1e-2 / (number + 1), device="cuda"))
            losses.append((loss.item(), norm.item()))
        return losses, [p.detach().clone() for p in model.parameters()]
    (eager_losses, eager_weights), (graph_losses, graph_weights) = run(False), run(True)
    assert graph_losses == pytest.approx(eager_losses, rel=1e-6)
    for a, b in zip(graph_weights, eager_weights):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
