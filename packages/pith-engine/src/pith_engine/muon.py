"""Muon for the hidden matrices, AdamW for every other parameter, as one optimizer (one state, one clip, one
checkpoint).

Muon's step of a matrix W (fp32 master) with gradient G (divided by clipped_step's grad_scale):
    B <- momentum * B + G;   U = G + momentum * B (Nesterov) or B;   O = NS(U)
    W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(rows, columns)) * O
NS, the Newton-Schulz quintic iteration, takes U / |U|_F (transposed when it has more rows than columns, so that
X X^T is the smaller Gram matrix) through X <- a X + (b A + c A^2) X with A = X X^T, `ns_steps` times: the
coefficients (3.4445, -4.7750, 2.0315) push every singular value towards 1 in few steps without converging exactly,
so O is about U's orthogonal factor. Its RMS is then about 1 / sqrt(max(rows, columns)); the factor 0.2 x
sqrt(max(rows, columns)) (Moonlight's) brings it to the RMS of a typical AdamW update, so one learning rate and one
weight decay serve both kinds of parameter. NS runs in bf16 on CUDA (as fast as it needs to be: O is approximate by
design) and in fp32 on CPU. A tensor [..., rows, columns] is a batch of matrices (an expert stack: each expert's
own). Like pith_engine.optim.AdamW, it reads the clip's grad_scale and found_inf on the device: no host sync, so a
CUDA graph captures the step; where found_inf is set, weights, momentum and step count stay as they were.

Sharded weights. FSDP2 gives each rank some rows of each matrix (dense weights over dp x cp x ep, Shard(0); expert
stacks over dp x cp, Shard(1): the rows of each expert's matrix), but NS needs the whole matrix. Rather than every
rank gathering every matrix, the matrices of each shard group are dealt out, each whole to one rank (balanced by
their NS cost); one all-to-all brings each rank the rows of the matrices it owns, it orthogonalizes them, and one
all-to-all returns each rank its rows of the results. Each rank so orthogonalizes about 1/G of its group's
matrices. Under HSDP every replica does this within itself; a pipeline rank alone holds whole matrices.
"""
import functools
import math

import torch
import torch.distributed as dist

from pith_engine.data_parallel import is_sharded, local_part
from pith_engine.moe import all_to_all
from pith_engine.optim import AdamW, clip_flags, count_step, decay_groups

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2   # Moonlight: 0.2 x sqrt(max(rows, columns)) x O has about the RMS of an AdamW update


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """About the orthogonal factor of each matrix of update [..., rows, columns] by `steps` Newton-Schulz
    iterations, computed (and returned) in dtype."""
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:   # the Gram matrix of the shorter side
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)   # every singular value now at most 1
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(AdamW):
    """AdamW (pith_engine.optim.AdamW, its path unchanged) for the param groups without `muon`; Muon for those with
    muon=True, which hold `momentum`, `nesterov` and `ns_steps` (muon() makes both kinds). A Muon parameter's state is
    its step count and momentum_buffer (fp32, sharded as the parameter)."""

    def update(self):
        """AdamW.step's work: the AdamW groups through its path, then the Muon groups."""
        self.adamw_step([group for group in self.param_groups if not group.get("muon")])
        with_grads = [(p, group) for group in self.param_groups if group.get("muon") for p in group["params"]
                      if p.grad is not None]
        if with_grads:
            self.muon_step(with_grads)

    def state_of(self, param: torch.Tensor) -> dict:
        """The parameter's state (made on first use), AdamW's or Muon's."""
        state = self.state[param]
        if state or not any(p is param for group in self.param_groups if group.get("muon") for p in group["params"]):
            return super().state_of(param)
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["momentum_buffer"] = torch.zeros_like(param)
        return state

    def muon_step(self, with_grads: list[tuple[torch.Tensor, dict]]):
        """Momentum, NS and the update of each parameter: a whole one at once (so that only one parameter's
        temporaries are alive at a time), sharded ones by shard group, one group after another in the order the
        parameters first name them (the same on every rank of a group, as its collectives need)."""
        device = with_grads[0][0].device
        grad_scale, found_inf = clip_flags(self, device)
        skipped = found_inf != 0
        states = [self.state_of(p) for p, _ in with_grads]
        count_step(states, found_inf)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # NS's
        sharded = {}
        for (p, group), state in zip(with_grads, states):
            update = momentum_update(p, group, state["momentum_buffer"], grad_scale, skipped)
            shards = shard_group(p)
            if shards is None:
                apply_update(p, group, orthogonalize(update, group["ns_steps"], dtype), skipped)
            else:   # in NS's dtype until the group's turn: less memory held
                sharded.setdefault(shards, []).append((p, group, update.to(dtype)))
        for shards, held in sharded.items():
            parts = split_orthogonalize([u for _, _, u in held], [p.shape[-2] for p, _, _ in held],
                                        [group["ns_steps"] for _, group, _ in held], shards, dtype)
            for (p, group, _), part in zip(held, parts):
                apply_update(p, group, part, skipped)


def momentum_update(param: torch.Tensor, group: dict, buffer: torch.Tensor, grad_scale: torch.Tensor,
                    skipped: torch.Tensor) -> torch.Tensor:
    """The momentum buffer B <- momentum * B + G (G the gradient over grad_scale; B kept where skipped: a skipped
    step's gradient may be inf or nan) -> the update NS orthogonalizes: G + momentum * B (Nesterov) or B. Local
    rows of a sharded parameter: elementwise, so a rank's own."""
    grad, buffer = local_part(param.grad) / grad_scale, local_part(buffer)
    moved = torch.add(grad, buffer, alpha=group["momentum"])
    buffer.copy_(torch.where(skipped, buffer, moved))
    return grad.add_(moved, alpha=group["momentum"]) if group["nesterov"] else moved


def apply_update(param: torch.Tensor, group: dict, orthogonal: torch.Tensor, skipped: torch.Tensor):
    """W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(rows, columns)) * O, on this rank's rows of W and O,
    except where skipped; rows and columns are the whole matrix's."""
    lr, local = group["lr"], local_part(param)
    scale = RMS_MATCH * math.sqrt(max(param.shape[-2:]))
    moved = local * (1 - lr * group["weight_decay"]) - (lr * scale) * orthogonal
    local.copy_(torch.where(skipped, local, moved))


def shard_group(param: torch.Tensor):
    """The process group across which FSDP2 split the rows of param's matrices; None where this rank holds them whole
    (one process, a pipeline rank alone, a shard group of one rank)."""
    if not is_sharded(param):
        return None
    from torch.distributed.tensor import Shard
    dims = [(i, p.dim) for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if not dims or param.device_mesh.size(dims[0][0]) == 1:
        return None
    mesh_dim, tensor_dim = dims[0]
    if len(dims) > 1 or tensor_dim != param.ndim - 2:
        raise ValueError(f"Muon needs a parameter's matrices sharded by rows over one mesh dimension, not "
                         f"{param.placements} of a {param.ndim}-d parameter")
    return param.device_mesh.get_group(mesh_dim)


def row_counts(rows: int, ranks: int) -> list[int]:
    """The rows of a matrix each rank of a shard group holds: torch.chunk's split, as FSDP2 shards (the last ranks may
    hold fewer, or none)."""
    chunk = -(-rows // ranks)
    return [min(chunk, max(0, rows - rank * chunk)) for rank in range(ranks)]


@functools.lru_cache(maxsize=16)   # the same every step: dealt once (thousands of experts take milliseconds)
def deal(costs: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    """The rank that owns each matrix: the costliest first, each to the least loaded rank so far (ties: the lowest),
    the same on every rank."""
    loads, owners = [0] * ranks, [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        owners[k] = min(range(ranks), key=lambda r: loads[r])
        loads[owners[k]] += costs[k]
    return tuple(owners)


def split_orthogonalize(updates: list[torch.Tensor], rows: list[int], steps: list[int], group,
                        dtype: torch.dtype) -> list[torch.Tensor]:
    """NS of the matrices of sharded updates (each [..., local rows, columns] of a parameter with `rows` rows per
    matrix, sharded over `group`), each matrix whole on one rank: this rank's rows of every result."""
    shapes = [u.shape for u in updates]
    updates = [u.to(dtype).reshape(math.prod(u.shape[:-2]), *u.shape[-2:]) for u in updates]   # in NS's dtype
    dealt = Dealt(updates, rows, dist.get_world_size(group), dist.get_rank(group))
    done = orthogonalize_each(dealt.gather(updates, group), [steps[i] for i, _ in dealt.owned[dealt.me]])
    return [result.view(shape) for result, shape in zip(dealt.scatter(done, updates, group), shapes)]


class Dealt:
    """Matrices (i, b), matrix b of update i [matrices, local rows, columns], dealt out over a shard group: `owned`,
    each rank's; `counts[i]`, the rows of update i's matrices each rank holds."""

    def __init__(self, updates: list[torch.Tensor], rows: list[int], ranks: int, me: int):
        self.ranks, self.me, self.columns = ranks, me, [u.shape[-1] for u in updates]
        self.counts = [row_counts(r, ranks) for r in rows]
        matrices = [(i, b) for i, u in enumerate(updates) for b in range(u.shape[0])]
        owners = deal(tuple(rows[i] * self.columns[i] * min(rows[i], self.columns[i]) for i, _ in matrices), ranks)
        self.owned = [[m for m, owner in zip(matrices, owners) if owner == rank] for rank in range(ranks)]

    def size(self, i: int, rank: int) -> int:
        """Elements of rank's rows of one matrix of update i."""
        return self.counts[i][rank] * self.columns[i]

    def gather(self, updates: list[torch.Tensor], group) -> list[torch.Tensor]:
        """The matrices this rank owns, whole: every rank's rows of them, by one all-to-all."""
        ranks, mine = range(self.ranks), self.owned[self.me]
        sent = flat([updates[i][b] for rank in ranks for i, b in self.owned[rank]], updates[0])
        received = all_to_all(sent, [sum(self.size(i, self.me) for i, _ in self.owned[rank]) for rank in ranks],
                              [sum(self.size(i, rank) for i, _ in mine) for rank in ranks], group)
        pieces = iter(received.split([self.size(i, rank) for rank in ranks for i, _ in mine]))
        by_rank = [[next(pieces).view(-1, self.columns[i]) for i, _ in mine] for _ in ranks]
        return [torch.cat([by_rank[rank][k] for rank in ranks]) for k in range(len(mine))]

    def scatter(self, done: list[torch.Tensor], updates: list[torch.Tensor], group) -> list[torch.Tensor]:
        """Each rank its rows of the owned matrices' results `done`, by one all-to-all: this rank's rows of every
        matrix, shaped as `updates`."""
        ranks, mine = range(self.ranks), self.owned[self.me]
        first = [[sum(counts[:rank]) for rank in ranks] for counts in self.counts]   # each rank's first row
        back = flat([done[k][first[i][rank]:first[i][rank] + self.counts[i][rank]]
                     for rank in ranks for k, (i, _) in enumerate(mine)], updates[0])
        returned = all_to_all(back, [sum(self.size(i, rank) for i, _ in mine) for rank in ranks],
                              [sum(self.size(i, self.me) for i, _ in self.owned[rank]) for rank in ranks], group)
        pieces = iter(returned.split([self.size(i, self.me) for rank in ranks for i, _ in self.owned[rank]]))
        results = [torch.empty_like(u) for u in updates]
        for rank in ranks:
            for i, b in self.owned[rank]:
                results[i][b] = next(pieces).view(results[i][b].shape)
        return results


def flat(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The tensors' elements one after another (none: an empty tensor like `like`, for a rank that owns nothing)."""
    return torch.cat([t.flatten() for t in tensors]) if tensors else like.new_empty(0)


def orthogonalize_each(whole: list[torch.Tensor], steps: list[int]) -> list[torch.Tensor]:
    """NS of each matrix, those of one shape and step count as one batch (the experts of a stack a rank owns)."""
    done, batches = [None] * len(whole), {}
    for k, (matrix, count) in enumerate(zip(whole, steps)):
        batches.setdefault((matrix.shape, count), []).append(k)
    for (_, count), ks in batches.items():
        for k, result in zip(ks, orthogonalize(torch.stack([whole[k] for k in ks]), count, whole[ks[0]].dtype)):
            done[k] = result
    return done


def muon(model: torch.nn.Module, matrices: list[torch.Tensor], lr: float, weight_decay: float, momentum: float = 0.95,
         nesterov: bool = True, ns_steps: int = 5, betas=(0.9, 0.95)) -> Muon:
    """Muon for `matrices` (parameters of model; each [..., rows, columns] a batch of matrices), with decoupled weight
    decay; AdamW for the model's other parameters, grouped as pith_engine.optim.adamw groups them; one lr for all."""
    chosen = {id(p) for p in matrices}
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    groups = [dict(params=list(matrices), muon=True, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                   ns_steps=ns_steps), *decay_groups(named, weight_decay)]
    return Muon([group for group in groups if group["params"]], lr=lr, betas=betas)
