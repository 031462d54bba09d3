"""Mixed precision on every layout, data parallelism with FSDP2, and the global gradient-norm clip.

Parameters are always fp32: the master copy the optimizer updates, with fp32 gradients and AdamW state.
Compute runs in `param_dtype` (bf16): on several processes FSDP2 casts what it gathers; on one process
each forward of the model reads every parameter through its bf16 copy (`ComputeCasts`, one copy per
optimizer step), whose backward adds the gradient into the fp32 `.grad`. Either way a layer computes with
the same bf16 weights, and a parameter its module declares float32 (contract.fp32_names) in float32.

Expert weights are sharded over dp x cp (expert-parallel ranks hold different experts); every other
weight over dp x cp x ep (expert-parallel ranks read different data, so they are data-parallel for those
weights). Parameters stay fp32 (the master copy the optimizer updates); compute runs in `param_dtype`;
gradients are reduced in fp32 as a sum, not a mean, because each rank's loss is already divided by the
global token count. After sharding, every parameter element lives on exactly one rank (per pipeline
stage), which is what makes the clip's all-reduced sum of squares exact. Under HSDP (Parallel.dp_replicate R) each
is sharded the same way within each of R replicas and its gradient all-reduced across them: the norm then sums
over one replica.
"""
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pith_engine.contract import MoeModel, fp32_names, moe_layers
from pith_engine.parallel import Parallel
from pith_ops.grouped_gemm import WgradPairs


def shard_model(model: MoeModel, parallel: Parallel, param_dtype: torch.dtype | None = None) -> MoeModel:
    """Make the fp32 `model` compute in param_dtype (None: in fp32) on this layout, in place. Several
    processes: FSDP2, bottom-up: each layer's experts, each decoder layer, then the root (embedding, final norm,
    LM head), whose forward (logits, or the loss with labels) gathers and frees the weights. Under a pipeline,
    whose pieces the model's forward runs one at a time, the modules owning those last weights are roots of their
    own instead of the model, as is each layer (a chunk's forward calls it): each piece then gathers only its own
    weights, an overlapped pair's forward and backward share no FSDP state, and each root lets its gathered weights
    go after its forward (FSDP2 keeps a root's for its backward otherwise: through every micro-batch in flight);
    within a chunk each gathers the next one's ahead (_start_chunk). One process, or pipeline ranks alone (each
    holds its own layers, nothing to shard): the casts of ComputeCasts. Either way a parameter declared float32
    (contract.fp32_names) computes in float32 (under FSDP2 its module's are a unit of their own: `shard`). Works on a
    model still on the meta device (then to_empty, then init_weights)."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise TypeError(f"shard_model takes a float32 model (the master weights), not {next(model.parameters()).dtype}; "
                        "param_dtype sets the compute dtype")
    if not parallel.sharded:
        if param_dtype not in (None, torch.float32):
            ComputeCasts(param_dtype).register(model)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy  # DTensor: ~0.7 s to import
    from torch.distributed.tensor import Shard
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    expert_mesh, dense_mesh = parallel.shard_mesh("dp", "cp"), parallel.shard_mesh("dp", "cp", "ep")
    # a root keeps its gathered weights after its forward unless told otherwise (None: FSDP2's choice)
    dense = dict(mesh=dense_mesh, mp_policy=policy, reshard_after_forward=True if parallel.pp > 1 else None)
    for layer in model.layers.values():
        if layer.is_moe:   # rows (dim 1), so that each expert's slice of the stack is itself a row shard
            shard(layer.experts, mesh=expert_mesh, mp_policy=policy, shard_placement_fn=lambda p: Shard(1))
        if shard(layer, **dense):
            layer.fullgraph = False   # stage 1 then runs the hooks of float32 units, which dynamo does not trace
    in_layers = {id(param) for layer in model.layers.values() for param in layer.parameters()}
    owners = [module for module in model.modules() if any(id(p) not in in_layers for p in module.parameters(False))]
    for root in owners if parallel.pp > 1 else [model]:
        shard(root, **dense)
    if parallel.pp > 1:
        model.register_forward_pre_hook(_start_chunk, with_kwargs=True)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)   # plain SUM: gloo has no pre-multiplied sum
    return model


def shard(module: torch.nn.Module, mp_policy, **options) -> bool:
    """fully_shard(module, mp_policy, **options), except for the parameters declared float32 (contract.fp32_names) of
    the modules under it that no earlier call shards: the module owning such parameters gets a unit of its own for
    them with a float32 policy, made after this one, which leaves them out (ignored_params: a unit made first, as FSDP2
    nests them, would take its module's other parameters too); `module` itself, when all its parameters are declared
    float32, is sharded with that policy. -> whether units of their own were made."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    fp32, owners, unheld = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False), {}, [module]
    while unheld:
        inner = unheld.pop()
        if fp32_names(inner):
            owners[inner] = {inner._parameters[name] for name in fp32_names(inner)}
        unheld += [child for child in inner.children() if not isinstance(child, FSDPModule)]
    kept = set().union(*owners.values())
    if module in owners:
        if kept != set(module.parameters()):
            raise TypeError(f"{type(module).__name__} holds float32 parameters ({', '.join(fp32_names(module))}) and "
                            "others, and FSDP shards it as one unit; declare them on a module inside it")
        mp_policy, owners = fp32, {}
    fully_shard(module, mp_policy=mp_policy, ignored_params=kept or None, **options)
    for owner, params in owners.items():
        fully_shard(owner, mp_policy=fp32, ignored_params=set(owner.parameters()) - params, **options)
    return bool(owners)


def _start_chunk(model, args, kwargs):
    """Before each call of a pipeline rank's model (a chunk: its `layers`), what FSDP2 does for the layers under one
    root, here roots of their own: in the forward a layer gathers its experts' weights as it starts and the experts
    the next layer's; in the backward a layer its experts', they the layer's before. So that one may gather the
    next, each is set up once (else done at its first forward) and, at every call, its gathers ordered after the
    work issued so far (the optimizer's step, which writes the shards they read), as at its own forward. Nothing
    across chunks: what runs after a chunk is another micro-batch's."""
    layers = [model.layers[n] for n in kwargs.get("layers") or model.layers]
    chunks = model.__dict__.setdefault("_prefetching_chunks", set())   # set up once per chunk
    if tuple(map(id, layers)) not in chunks:
        chunks.add(tuple(map(id, layers)))
        parts = [[layer, *([layer.experts] if layer.is_moe else [])] for layer in layers]
        forward, backward = sum(parts, []), sum(reversed(parts), [])
        for module, after in zip(forward, forward[1:]):
            module.set_modules_to_forward_prefetch([after])
        for module, after in zip(backward, backward[1:]):
            module.set_modules_to_backward_prefetch([after])
        for layer in layers:
            layer._get_fsdp_state()._lazy_init()
    for layer in layers:
        state = layer._get_fsdp_state()
        for stream in (state._comm_ctx.all_gather_copy_in_stream, state._comm_ctx.all_gather_stream):
            stream.wait_stream(state._device_handle.current_stream())


class ComputeCasts:
    """One process's mixed precision: for the duration of each forward of the model, every fp32 parameter (but those
    declared to compute in float32: contract.fp32_names) is swapped for its copy in dtype (as
    torch.func.functional_call swaps tensors in). A copy is made when
    its parameter has changed (an optimizer step, a load) and reused by the other micro-batches of the step;
    its backward adds the gradient into the fp32 `.grad` in one pass (AddIntoGrad), where a cast in the
    graph would write an fp32 gradient and then add it. Each copy names its parameter as `grad_into`, so that
    a kernel that can add in fp32 itself does (grouped_linear's weight gradient, `embedding`), returning no
    gradient to autograd. Every optimizer step makes the copies stale as it starts (fused AdamW writes the
    parameters without bumping their version counters): they are dropped, or, `kept` (keep_compute_copies), kept in
    their memory for pith_engine.optim.AdamW to write as it updates their parameters (copy_to_update), and cast
    again in place where it did not. drop_compute_copies drops copies that are not kept earlier. Other changes are
    seen through the version counter, which every in-place write bumps (loads, init) except one through `.data`."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.swapped, self.copies, self.kept = dtype, [], {}, False
        hook = register_optimizer_step_pre_hook(forget_copies_of(weakref.ref(self)))
        weakref.finalize(self, hook.remove)

    def register(self, model: torch.nn.Module):
        model.compute_casts = self   # for drop_compute_copies
        model.register_forward_pre_hook(self.cast)
        model.register_forward_hook(self.restore, always_call=True)   # also when the forward raises

    def copy_of(self, param: torch.Tensor) -> torch.Tensor:
        state = version_of(param)
        known = self.copies.get(id(param))
        if known is not None and known[0] != state and self.kept and known[1].shape == param.shape:
            known[0] = state   # cast again in place, into the memory a replayed CUDA graph of the step reads
            known[1].copy_(param.detach())
        elif known is None or known[0] != state:
            known = self.copies[id(param)] = [state, param.detach().to(self.dtype)]
        copy = AddIntoGrad.apply(param, known[1])
        copy.grad_into = param   # for a kernel that adds its gradient into param.grad itself (grouped_linear)
        return copy

    def copy_to_update(self, param: torch.Tensor) -> torch.Tensor | None:
        """For the optimizer about to update param (and write the result in its copy): the kept copy, from then on
        current (None where none is kept)."""
        known = self.copies.get(id(param)) if self.kept else None
        if known is None:
            return None
        known[0] = version_of(param)
        return known[1]

    def cast(self, model, args):
        for module in model.modules():
            kept = fp32_names(module)   # declared to compute in float32
            for name, param in module._parameters.items():
                if param is not None and param.dtype == torch.float32 and name not in kept:
                    self.swapped.append((module, name, param))
                    module._parameters[name] = self.copy_of(param)

    def restore(self, model, args, output):
        for module, name, param in self.swapped:
            module._parameters[name] = param
        self.swapped.clear()


def version_of(param: torch.Tensor) -> tuple[int, int]:
    """What a copy of param was made from: an in-place update (but an optimizer's fused one) or a new storage
    changes it."""
    return param._version, param.data_ptr()


def add_grads_in_kernels(model: torch.nn.Module):
    """For a one-process model that computes in its own parameters' dtype (a bf16 model, without ComputeCasts):
    each parameter names itself as `grad_into`, so that the kernels that can add their gradient into .grad
    themselves do (grouped_linear's weight gradient on CUDA, `embedding`), where autograd would write each
    micro-batch's gradient and then add it, one more write and two more reads of it."""
    for param in model.parameters():
        param.grad_into = param


def pair_expert_wgrads(model: MoeModel) -> WgradPairs:
    """For a one-process model that takes several micro-batches per step: its experts' weight-gradient kernel,
    where it adds into .grad itself (`grad_into`, on CUDA), runs once per two micro-batches (WgradPairs, kept
    as model.wgrad_pairs, which the step flushes after its last backward)."""
    pairs = model.wgrad_pairs = WgradPairs()
    for layer in moe_layers(model):
        layer.experts.wgrad_pairs = pairs
    return pairs


def keep_compute_copies(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """For a one-process mixed-precision model that takes several micro-batches per step: its bf16 copies live from
    step to step and `optimizer` (pith_engine.optim.AdamW, or Muon) writes each as it updates its parameter, so the
    step casts no weight (not yet measured on a GPU). Their memory is not freed by the last backward
    (drop_compute_copies leaves them), which with several micro-batches lowers no peak: the copies are alive
    at each earlier micro-batch's backward."""
    casts = getattr(model, "compute_casts", None)
    if casts is not None:
        casts.kept, optimizer.compute_casts = True, casts


def drop_compute_copies(model: torch.nn.Module):
    """Forget the bf16 copies a one-process mixed-precision model holds for its next forward, unless they are kept
    (keep_compute_copies; nothing on other layouts). For after the step's last forward: its backward then frees each
    copy once its layer is done, where the held copies (the bf16 size of every weight) would add to the backward's
    peak memory."""
    casts = getattr(model, "compute_casts", None)
    if casts is not None and not casts.kept:
        casts.copies.clear()


def fsdp_modules(model: torch.nn.Module) -> list:
    if not dist.is_initialized():
        return []
    from torch.distributed.fsdp import FSDPModule
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def hold_gradients(model: torch.nn.Module):
    """Until reduce_held_gradients, FSDP reduces nothing after a backward: each parameter's gradient stays unsharded,
    summed over the backwards in the reduce dtype (fp32). For weight gradients that come after their layer's
    backward has ended (a pipeline's W steps): its reduce-scatter would miss them."""
    for module in fsdp_modules(model):
        module.set_requires_gradient_sync(False, recurse=False)


def fold_held_gradients(model: torch.nn.Module):
    """Add the gradients written since the last backward (a W step's, in the compute dtype) into the fp32 sums FSDP
    holds, as its post-backward does: a later backward would otherwise add into them in bf16."""
    for group in _fsdp_param_groups(model):
        for fsdp_param in group.fsdp_params:
            fsdp_param.accumulate_unsharded_grad_if_needed()
            fsdp_param.to_accumulated_grad_if_needed()


def reduce_held_gradients(model: torch.nn.Module):
    """Reduce-scatter every gradient held since hold_gradients into the sharded .grad, through FSDP's own
    post-backward (which has no public call; torch.distributed.pipelining runs it the same way for its zero-bubble
    schedules), and turn the reduction after each backward back on."""
    for module in fsdp_modules(model):
        module.set_requires_gradient_sync(True, recurse=False)
    groups = _fsdp_param_groups(model)
    for group in reversed(groups):
        group.post_backward()
    for group in groups:
        group.finalize_backward()   # the reduce-scatters waited for


def _fsdp_param_groups(model):
    return [group for module in fsdp_modules(model) for group in module._get_fsdp_state()._fsdp_param_groups]


def release_forward_weights(model: torch.nn.Module):
    """After forwards with no backward to follow (evaluation): drop a one-process model's bf16 copies (but kept ones,
    which its optimizer writes in a replayed step too) and the FP8 blocks its `fp8_cache` made (pith_apps' use_fp8),
    which a replayed step (StepGraph: no optimizer hook drops them) would otherwise read stale, and put the weights
    FSDP's root gathered back into shards (the root keeps them after its forward for the backward that usually
    follows; until resharded, the model's parameters are not the optimizer's, which a save reads)."""
    drop_compute_copies(model)
    if getattr(model, "fp8_cache", None) is not None:
        model.fp8_cache.new_step()
    for module in fsdp_modules(model):
        module.reshard()


def forget_copies_of(casts_ref):
    """An optimizer-step hook that drops the copies of the ComputeCasts behind the weak reference, or marks kept ones
    stale (a weak one, so that the hook, which torch keeps for the process, does not keep the copies alive)."""
    def hook(optimizer, args, kwargs):
        casts = casts_ref()
        if casts is not None and casts.kept:
            for known in casts.copies.values():
                known[0] = None
        elif casts is not None:
            casts.copies.clear()
    return hook


class AddIntoGrad(torch.autograd.Function):
    """`copy` (param in a compute dtype) in the forward; the backward adds the gradient into param.grad
    itself, converting as it adds, and passes nothing on."""

    @staticmethod
    def forward(ctx, param, copy):
        ctx.param = param
        ctx.set_materialize_grads(False)
        return copy.detach()   # a new tensor on the copy's storage, for autograd to attach this node to

    @staticmethod
    def backward(ctx, grad):
        param = ctx.param
        if grad is None:   # its consumers added their gradients into param.grad themselves (grad_into)
            return None, None
        if param.grad is None:
            param.grad = torch.empty_like(param).copy_(grad)   # the parameter's layout, as autograd would
        else:
            param.grad.add_(grad)
        return None, None


class _EmbeddingIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, into):
        ctx.save_for_backward(ids)
        ctx.into = into
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        if ctx.into.grad is None:
            ctx.into.grad = torch.zeros_like(ctx.into)
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.into.grad.dtype)
        ctx.into.grad.index_put_((ids.flatten(),), rows, accumulate=True)   # CUDA: sorted, deterministic
        return None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """F.embedding, except for a weight that names its master as `grad_into` (ComputeCasts' copies) where
    fused (default: on CUDA): the backward adds each token's gradient row into the master's fp32 .grad,
    where F.embedding's writes a dense [vocab, hidden] gradient in the copy's dtype, which AddIntoGrad then
    reads whole to add it."""
    into = getattr(weight, "grad_into", None)
    if into is None or not (ids.is_cuda if fused is None else fused):
        return torch.nn.functional.embedding(ids, weight)
    return _EmbeddingIntoGrad.apply(ids, weight, into)


def is_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor, which only a process group can have made: without one, DTensor is not even imported."""
    if not dist.is_initialized():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_sharded(tensor) else tensor


def this_ranks_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `full` (the same on every rank) that this rank holds of `like`, a parameter FSDP may have
    sharded; the slicing is local, nothing is sent."""
    if not is_sharded(like):
        return full
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


@torch.no_grad()
def grad_norm(parameters, parallel: Parallel | None = None) -> torch.Tensor:
    """The global L2 norm of the gradients, each element counted once: each rank sums the squares of the gradient
    elements it holds; one all-reduce over the world adds them (parallel None: whatever group is initialized), or
    under HSDP over one replica's ranks (`Parallel.norm_group`): the replicas hold the same reduced gradients, so a
    sum over the world would count each dp_replicate times and give a norm sqrt(dp_replicate) too large.
    Each gradient's norm is taken row by row (its last dimension) and the squares summed by `sum`, which adds
    pairwise: torch's CPU kernel for one tensor's norm runs its float32 accumulators through all the elements
    (pytorch/pytorch#169237), 3e-4 off on an 8192 x 128 LM head gradient where its rows are exact to 1e-7, and the
    clip scales every gradient by the norm; so a layout, whose shards are other lengths, took other steps than one
    process once the clip was active."""
    grads = [local_part(p.grad) for p in parameters if p.grad is not None]
    squares = torch.stack([torch.linalg.vector_norm(g, dim=-1, dtype=torch.float32).square().sum()
                           for g in grads]).sum()
    if parallel.replica_size > 1 if parallel is not None else dist.is_initialized():
        dist.all_reduce(squares, group=None if parallel is None else parallel.norm_group())
    return squares.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, parallel: Parallel | None = None) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most max_norm; returns the norm before. (The app
    leaves the scaling to its fused optimizer's step: pith_engine.optim.clipped_step.)"""
    parameters = list(parameters)
    norm = grad_norm(parameters, parallel)
    grads = [local_part(p.grad) for p in parameters if p.grad is not None]
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].dtype))
    return norm
