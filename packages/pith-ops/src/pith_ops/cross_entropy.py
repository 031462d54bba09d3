"""LM head + cross-entropy without the full [tokens, vocab] logits.

Tokens are processed in chunks: each chunk's logits are computed in fp32, turned into its loss and, in
the same pass, into the gradients of the hidden states and of the head weight (softmax minus one-hot),
then dropped. Backward only scales the stored gradients by the incoming scalar, so the logits are
never recomputed. For 4096 tokens and a 151,936 vocabulary the fp32 logits alone would be 2.5 GB;
here the peak is one chunk of them plus the weight gradient.
"""
import torch

IGNORE_INDEX = -100


def linear_cross_entropy_reference(hidden, weight, labels, ignore_index=IGNORE_INDEX):
    logits = (hidden @ weight.T).float()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size):
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
            logits = (h @ weight.T).float()
            valid = y != ignore_index
            target = torch.where(valid, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            loss += ((lse - logits.gather(1, target[:, None]).squeeze(1)) * valid).sum()
            # d loss / d logits = softmax - one_hot(label), zero for ignored tokens; computed in place
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits.scatter_add_(1, target[:, None], -torch.ones_like(lse)[:, None])
            grad_logits.mul_(valid[:, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:start + chunk_size])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, h)
        # kept on ctx, not saved: they are ours alone, so backward may scale them in place (no second
        # weight-sized buffer); the price is that this backward runs once (no retain_graph reuse)
        ctx.grads = (grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = tuple(g.mul_(grad_loss.to(g.dtype)) if g is not None else None for g in ctx.grads)
        del ctx.grads
        return *grads, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, chunk_size: int = 1024) -> torch.Tensor:
    """Token-summed fp32 cross-entropy of logits = hidden @ weight.T against labels.

    hidden [tokens, hidden_size], weight [vocab, hidden_size] (nn.Linear layout), labels [tokens] with
    ignore_index marking tokens that count for nothing. Gradients flow to hidden and weight.
    """
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"linear_cross_entropy: {hidden.shape[0]} hidden rows but {labels.shape[0]} labels")
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_size)
