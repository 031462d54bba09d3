"""Muon for the hidden matrices, AdamW for every other parameter, as one optimizer (one state, one clip, one
checkpoint).

Muon's step of a matrix W (fp32 master) with gradient G (divided by clipped_step's grad_scale):
    B <- momentum * B + G;   U = G + momentum * B (Nesterov) or B;   O = NS(U)
    W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(rows, columns)) * O
NS, the Newton-Schulz quintic iteration, takes U / |U|_F through X <- a X + (b A + c A^2) X with A = X X^T (for a
matrix taller than wide the same map as X <- a X + X (b A + c A^2), A = X^T X: the smaller Gram matrix), `ns_steps`
times: the coefficients (3.4445, -4.7750, 2.0315) push every singular value towards 1 in few steps without
converging exactly, so O is about U's orthogonal factor. Its RMS is then about 1 / sqrt(max(rows, columns)); the
factor 0.2 x sqrt(max(rows, columns)) (Moonlight's) brings it to the RMS of a typical AdamW update, so one learning
rate and one weight decay serve both kinds of parameter. NS runs in bf16 on CUDA (as fast as it needs to be: O is
approximate by design) and in fp32 on CPU. A tensor [..., rows, columns] is a batch of matrices (an expert stack:
each expert's own), and a matrix whose rows stack two projections (a SwiGLU expert's gate_up_proj, where the Hugging
Face files of Qwen3 and DeepSeek-V2 hold gate_proj and up_proj apart) is two, orthogonalized each on its own: NS's
FLOPs are then 43% of the stacked matrix's for Qwen3-30B-A3B's experts, 68% for DeepSeek-V2-Lite's. GPT-OSS's files
hold gate and up as one interleaved tensor, orthogonalized so (split, its square halves would cost 20% more). rows
and columns are those of the matrices orthogonalized. Like pith_engine.optim.AdamW, it reads the clip's grad_scale
and found_inf on the device: no host sync, so a CUDA graph captures the step; where found_inf is set, weights,
momentum and step count stay as they were.

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

from pith_ops.muon_update import muon_apply, muon_momentum

from pith_engine.data_parallel import is_sharded, local_part
from pith_engine.moe import all_to_all
from pith_engine.optim import AdamW, clip_flags, count_step, decay_groups, lr_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2   # Moonlight: 0.2 x sqrt(max(rows, columns)) x O has about the RMS of an AdamW update
# A shard group's updates are held (a rank's rows, in NS's dtype) until their parameters reach this many elements a
# rank of the group (whole sizes over the group's ranks: the same on every rank, where a rank's own rows are not, so
# every rank deals out at the same parameter and the collectives stay in one order), then dealt out and
# orthogonalized. At full depth, holding every layer's at once was estimated at 41 GiB a GPU for Qwen3-30B-A3B under
# dp 8 (skills/pith-apps/estimate-memory), 3.2 GiB in these buckets; 2^28 (512 MiB a rank in bf16) is still hundreds
# of matrices to deal out.
BUCKET_ELEMENTS = 2 ** 28
SPLITS = ("whole", "halves")   # a matrix's rows as one matrix, or as two: the first and the second half (a SwiGLU
#                                expert's gate and up projections)


def matrices_of(update: torch.Tensor, split: str) -> torch.Tensor:
    """update [..., rows, columns] as the batch [n, r, c] of matrices NS orthogonalizes each on its own."""
    if split == "halves":
        update = update.unflatten(-2, (2, -1))
    return update.reshape(-1, *update.shape[-2:])


def matrix_shape(shape: torch.Size, split: str) -> tuple[int, int]:
    """The rows and columns of each matrix NS orthogonalizes in a tensor of `shape`."""
    return (shape[-2] if split == "whole" else shape[-2] // 2), shape[-1]


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype, split: str = "whole") -> torch.Tensor:
    """About the orthogonal factor of each matrix of update [..., rows, columns] (split: SPLITS) by `steps`
    Newton-Schulz iterations, computed (and returned, in update's layout) in dtype. Each A X + b X term is one
    baddbmm (the sum in the GEMM's epilogue, not another pass); a tall matrix iterates as X (b A + c A^2), A = X^T X,
    the same map without transposing it."""
    x = matrices_of(update.to(dtype), split)
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)   # every singular value now at most 1
    a, b, c = NS_COEFFICIENTS
    wide = x.shape[-2] <= x.shape[-1]
    for _ in range(steps):
        gram = torch.bmm(x, x.mT) if wide else torch.bmm(x.mT, x)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a) if wide else torch.baddbmm(x, x, poly, beta=a)
    return x.view(update.shape)


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
        temporaries are alive at a time), sharded ones by shard group, a group's whenever they reach BUCKET_ELEMENTS
        and the rest in the order the parameters first name their groups (the same on every rank of a group, as its
        collectives need). On CUDA (or with use_kernel) the momentum and the update are pith_ops' one-pass kernels;
        elsewhere torch ops."""
        device = with_grads[0][0].device
        flags = clip_flags(self, device)
        states = [self.state_of(p) for p, _ in with_grads]
        count_step(states, flags[1])
        kernel = self.kernel_on(device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # NS's
        sharded = {}
        for (p, group), state in zip(with_grads, states):
            update = momentum_update(p, group, state["momentum_buffer"], flags, dtype, kernel)
            shards = shard_group(p)
            if shards is None:
                apply_update(p, group, orthogonalize(update, group["ns_steps"], dtype, group["split"]), flags, kernel)
                continue
            held = sharded.setdefault(shards, [])
            held.append((p, group, update))
            if sum(p.numel() for p, _, _ in held) >= BUCKET_ELEMENTS * dist.get_world_size(shards):
                step_sharded(sharded.pop(shards), shards, flags, kernel)   # the same on every rank
        for shards, held in sharded.items():
            step_sharded(held, shards, flags, kernel)


def step_sharded(held: list[tuple[torch.Tensor, dict, torch.Tensor]], shards, flags: tuple[torch.Tensor, torch.Tensor],
                 kernel: bool):
    """NS of the held (parameter, group, update in NS's dtype) of one shard group, dealt out over it, and each
    parameter's update."""
    parts = split_orthogonalize([u for _, _, u in held], [p.shape[-2] for p, _, _ in held],
                                [(group["ns_steps"], group["split"]) for _, group, _ in held], shards)
    for (p, group, _), part in zip(held, parts):
        apply_update(p, group, part, flags, kernel)


def momentum_update(param: torch.Tensor, group: dict, buffer: torch.Tensor, flags: tuple[torch.Tensor, torch.Tensor],
                    dtype: torch.dtype, kernel: bool) -> torch.Tensor:
    """The momentum buffer B <- momentum * B + G (G the gradient over the clip's grad_scale; B kept where found_inf is
    set: a skipped step's gradient may be inf or nan) -> the update NS orthogonalizes, in its dtype: G + momentum * B
    (Nesterov) or B (where skipped: any values, never applied). Local rows of a sharded parameter: elementwise, so a
    rank's own."""
    (grad_scale, found_inf), grad, buffer = flags, local_part(param.grad), local_part(buffer)
    if kernel:
        update = torch.empty_like(grad, dtype=dtype)
        muon_momentum(grad, buffer, update, group["momentum"], group["nesterov"], grad_scale, found_inf)
        return update
    grad = grad / grad_scale
    moved = torch.add(grad, buffer, alpha=group["momentum"])
    buffer.copy_(torch.where(found_inf != 0, buffer, moved))
    return (grad.add_(moved, alpha=group["momentum"]) if group["nesterov"] else moved).to(dtype)


def apply_update(param: torch.Tensor, group: dict, orthogonal: torch.Tensor, flags: tuple[torch.Tensor, torch.Tensor],
                 kernel: bool):
    """W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(rows, columns)) * O, on this rank's rows of W and O,
    except where found_inf is set; rows and columns are those of the whole matrices NS orthogonalized."""
    lr, local, found_inf = group["lr"], local_part(param), flags[1]
    scale = RMS_MATCH * math.sqrt(max(matrix_shape(param.shape, group["split"])))
    if kernel:
        muon_apply(local, orthogonal.contiguous(), lr_tensor(lr, local.device), group["weight_decay"], scale, found_inf)
        return
    moved = local * (1 - lr * group["weight_decay"]) - (lr * scale) * orthogonal
    local.copy_(torch.where(found_inf != 0, local, moved))


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


@functools.lru_cache(maxsize=256)   # the same every step: dealt once (thousands of experts take milliseconds)
def deal(costs: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    """The rank that owns each matrix: the costliest first, each to the least loaded rank so far (ties: the lowest),
    the same on every rank."""
    loads, owners = [0] * ranks, [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        owners[k] = min(range(ranks), key=lambda r: loads[r])
        loads[owners[k]] += costs[k]
    return tuple(owners)


def split_orthogonalize(updates: list[torch.Tensor], rows: list[int], ways: list[tuple[int, str]],
                        group) -> list[torch.Tensor]:
    """NS of the matrices of sharded updates (each [..., local rows, columns], in NS's dtype, of a parameter with
    `rows` rows per matrix, sharded over `group`; ways: each one's NS steps and split), each matrix whole on one
    rank: this rank's rows of every result."""
    shapes = [u.shape for u in updates]
    updates = [u.reshape(math.prod(u.shape[:-2]), *u.shape[-2:]) for u in updates]
    costs = [ns_cost(r, u.shape[-1], split) for r, u, (_, split) in zip(rows, updates, ways)]
    dealt = Dealt(updates, rows, costs, dist.get_world_size(group), dist.get_rank(group))
    done = orthogonalize_each(dealt.gather(updates, group), [ways[i] for i, _ in dealt.owned[dealt.me]])
    return [result.view(shape) for result, shape in zip(dealt.scatter(done, updates, group), shapes)]


class Dealt:
    """Matrices (i, b), matrix b of update i [matrices, local rows, columns], dealt out over a shard group: `owned`,
    each rank's; `counts[i]`, the rows of update i's matrices each rank holds."""

    def __init__(self, updates: list[torch.Tensor], rows: list[int], costs: list[int], ranks: int, me: int):
        self.ranks, self.me, self.columns = ranks, me, [u.shape[-1] for u in updates]
        self.counts = [row_counts(r, ranks) for r in rows]
        matrices = [(i, b) for i, u in enumerate(updates) for b in range(u.shape[0])]
        owners = deal(tuple(costs[i] for i, _ in matrices), ranks)
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


def ns_cost(rows: int, columns: int, split: str) -> int:
    """In proportion to NS's FLOPs on a [rows, columns] matrix split so."""
    pieces = 1 if split == "whole" else 2
    r = rows // pieces
    return pieces * r * columns * min(r, columns)


def orthogonalize_each(whole: list[torch.Tensor], ways: list[tuple[int, str]]) -> list[torch.Tensor]:
    """NS of each matrix (ways: its steps and split), those of one shape and way as one batch (the experts of a stack
    a rank owns)."""
    done, batches = [None] * len(whole), {}
    for k, (matrix, way) in enumerate(zip(whole, ways)):
        batches.setdefault((matrix.shape, way), []).append(k)
    for (_, (steps, split)), ks in batches.items():
        stack = torch.stack([whole[k] for k in ks])
        for k, result in zip(ks, orthogonalize(stack, steps, stack.dtype, split)):
            done[k] = result
    return done


def muon(model: torch.nn.Module, matrices: dict[str, list[torch.Tensor]], lr: float, weight_decay: float,
         momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, betas=(0.9, 0.95)) -> Muon:
    """Muon for `matrices` (parameters of model, by how their rows split into matrices: SPLITS; each
    [..., rows, columns] a batch of matrices), with decoupled weight decay; AdamW for the model's other parameters,
    grouped as pith_engine.optim.adamw groups them; one lr for all."""
    if set(matrices) - set(SPLITS):
        raise ValueError(f"muon: matrices are keyed by their split, one of {SPLITS}, not {sorted(matrices)}")
    chosen = {id(p) for params in matrices.values() for p in params}
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    groups = [*(dict(params=list(params), muon=True, split=split, weight_decay=weight_decay, momentum=momentum,
                     nesterov=nesterov, ns_steps=ns_steps) for split, params in matrices.items()),
              *decay_groups(named, weight_decay)]
    return Muon([group for group in groups if group["params"]], lr=lr, betas=betas)
