"""LM head + cross-entropy without the full [tokens, vocab] logits.

Tokens are processed in chunks: each chunk's logits are turned into its loss and, in the same pass,
into the gradient of the logits (softmax minus one-hot, written over them), from which the hidden states'
gradient is computed at once; the logits are never recomputed. The head weight's gradient of every chunk but
the last is summed in the forward; the last chunk's logits gradient is kept for the backward, which computes
its weight gradient with the incoming scalar folded into the chunk's hidden rows: with one chunk (a 4096-token
micro-batch at the default) no vocab-sized product is written and then scaled. A weight that names a
parameter as `grad_into` has its gradient added straight into that parameter's .grad (fp32 for master
weights), where the kernels run. For 4096 tokens and a 151,936 vocabulary the fp32 logits alone would be
2.5 GB; here the peak is one chunk of logits in the compute dtype, plus the weight gradient's sum when there
are several chunks.

On CUDA one Triton kernel per chunk reads the logits twice (online log-sum-exp, then the softmax
gradient written over the logits in place); elsewhere the same math runs in fp32 torch ops.
"""
import torch
import triton
import triton.language as tl

from pith_ops.grouped_gemm import add_product_into_grad

IGNORE_INDEX = -100


def linear_cross_entropy_reference(hidden, weight, labels, ignore_index=IGNORE_INDEX):
    logits = (hidden @ weight.T).float()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


@triton.jit
def _loss_and_grad_kernel(logits_ptr, labels_ptr, loss_ptr, vocab, ignore_index, BLOCK: tl.constexpr):
    """One row: loss = lse - logit[label]; logits row overwritten by softmax - one_hot (zero if ignored)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * vocab
    # per-lane online log-sum-exp; a finite floor instead of -inf keeps lanes past the vocab free of inf - inf
    running_max = tl.full((BLOCK,), -1e30, tl.float32)
    running_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, x)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(x - new_max)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    lse = row_max + tl.log(tl.sum(running_sum * tl.exp(running_max - row_max), axis=0))
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
        tl.store(base + cols, tl.where(valid, grad, 0.0).to(logits_ptr.dtype.element_ty), mask=cols < vocab)


def _chunk_loss_and_grad_kernel(logits, labels, ignore_index):
    losses = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _loss_and_grad_kernel[(logits.shape[0],)](logits, labels, losses, logits.shape[1], ignore_index,
                                              BLOCK=4096, num_warps=8)
    return losses.sum(), logits


def _chunk_loss_and_grad_torch(logits, labels, ignore_index):
    logits = logits.float()
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    loss = ((lse - logits.gather(1, target[:, None]).squeeze(1)) * valid).sum()
    grad = logits.sub_(lse[:, None]).exp_()   # in place: softmax - one_hot, zero for ignored tokens
    grad.scatter_add_(1, target[:, None], -torch.ones_like(lse)[:, None])
    return loss, grad.mul_(valid[:, None])


@triton.jit
def _scale_into_kernel(out_ptr, grad_ptr, scale_ptr, n, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """out (+)= grad * scale[0] in fp32, stored in out's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(grad_ptr + offsets, mask=offsets < n).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)
    if ACCUMULATE:
        value += tl.load(out_ptr + offsets, mask=offsets < n).to(tl.float32)
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=offsets < n)


def _scale_into(out, grad, scale, accumulate, use_kernel):
    """out (+)= grad * scale (a 0-dim tensor). The kernel reads the scale on the GPU: torch's mul_ by a 0-dim
    CUDA tensor measured 2.6x slower than by a Python number on the H200 (bench/RESULTS.md)."""
    if not (use_kernel and out.is_contiguous() and grad.is_contiguous()):
        return out.add_(grad * scale) if accumulate else out.copy_(grad * scale)
    _scale_into_kernel[(triton.cdiv(grad.numel(), 4096),)](out, grad, scale, grad.numel(), accumulate, BLOCK=4096)
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size, use_kernel, grad_mode):
        chunk_loss_and_grad = _chunk_loss_and_grad_kernel if use_kernel else _chunk_loss_and_grad_torch
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grad_mode and hidden.requires_grad else None
        grad_weight = last = last_hidden = None
        weight_grad, starts = grad_mode and weight.requires_grad, range(0, hidden.shape[0], chunk_size)
        for start in starts:
            h, y = hidden[start:start + chunk_size], labels[start:start + chunk_size]
            chunk_loss, grad_logits = chunk_loss_and_grad(h @ weight.T, y.contiguous(), ignore_index)
            loss += chunk_loss
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:start + chunk_size])
            if weight_grad and start == starts[-1]:
                last, last_hidden = grad_logits, h   # its weight gradient waits for the backward (the scale into h)
            elif weight_grad:
                grad_weight = grad_logits.T @ h if grad_weight is None else grad_weight.addmm_(grad_logits.T, h)
        # kept on ctx, not saved: they are ours alone, so backward may scale them in place (no second
        # weight-sized buffer); the price is that this backward runs once (no retain_graph reuse)
        ctx.grads, ctx.last, ctx.use_kernel = (grad_hidden, grad_weight), last, use_kernel
        ctx.save_for_backward(last_hidden)
        ctx.into = getattr(weight, "grad_into", None) if use_kernel else None
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_hidden, grad_weight), last, into, use_kernel = ctx.grads, ctx.last, ctx.into, ctx.use_kernel
        del ctx.grads, ctx.last
        grad_loss = grad_loss.float()
        if grad_hidden is not None:
            _scale_into(grad_hidden, grad_hidden, grad_loss, False, use_kernel)
        if last is None:
            return grad_hidden, None, None, None, None, None, None
        grad_logits, (h,) = last, ctx.saved_tensors
        h = h * grad_loss.to(h.dtype)   # the scale on the chunk's few hidden rows, not on a vocab-sized product
        if into is not None:
            if grad_weight is not None:   # the earlier chunks' sum
                first = into.grad is None
                if first:
                    into.grad = torch.empty_like(into)
                _scale_into(into.grad, grad_weight, grad_loss, not first, use_kernel)
            add_product_into_grad(into, grad_logits.T, h)
            grad_weight = None   # it is in into.grad: autograd gets none
        elif grad_weight is not None:
            _scale_into(grad_weight, grad_weight, grad_loss, False, use_kernel)
            grad_weight.addmm_(grad_logits.T, h)
        else:
            grad_weight = grad_logits.T @ h
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, chunk_size: int = 4096,
                         use_kernel: bool | None = None) -> torch.Tensor:
    """Token-summed fp32 cross-entropy of logits = hidden @ weight.T against labels.

    hidden [tokens, hidden_size], weight [vocab, hidden_size] (nn.Linear layout), labels [tokens] with
    ignore_index marking tokens that count for nothing. Gradients flow to hidden and weight. chunk_size tokens'
    logits at a time: 4096 (a 4096-token sequence whole, 1.2 GB of bf16 logits at Qwen3's vocabulary; one LM-head
    GEMM of each kind instead of four, the weight gradient written once instead of accumulated four times) trained
    the three families 1.8-3.6% faster than 1024 on the H200, for 0.4-0.8 GiB more peak memory (bench/RESULTS.md).
    The Triton kernels run on CUDA tensors (or when use_kernel=True, e.g. under TRITON_INTERPRET=1); there a weight
    that carries `grad_into` (a compute copy of a master parameter, or a parameter naming itself) gets no
    gradient through autograd: its gradient is added into grad_into.grad. An out-of-range label is a ValueError,
    except while a CUDA graph is being captured.
    """
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"linear_cross_entropy: {hidden.shape[0]} hidden rows but {labels.shape[0]} labels")
    # one host sync; unchecked, an out-of-range label reads past its logits row on the GPU. Not while a CUDA graph
    # is captured, which cannot wait for the host (the app checks its tokenizer against the vocabulary instead)
    outside = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
    if not (labels.is_cuda and torch.cuda.is_current_stream_capturing()) and outside.any():
        position = outside.nonzero()[0, 0].item()
        raise ValueError(f"linear_cross_entropy: label {labels[position].item()} at position {position} is outside "
                         f"the vocabulary 0..{weight.shape[0] - 1}; valid labels are those and ignore_index={ignore_index}")
    use_kernel = hidden.is_cuda if use_kernel is None else use_kernel
    # apply() runs forward without grad mode: under torch.no_grad (an evaluation) no gradient is computed
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_size, use_kernel,
                                     torch.is_grad_enabled())
