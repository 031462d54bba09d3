"""Parallel: how the world's ranks are laid out, as a (pp, dp, cp, ep) device mesh, outer to inner.

Built once by the app and passed down explicitly: the groups of a layout come from it, never from a global (what
spans the whole world uses the default group: checkpoints' rank 0). Rank r sits at mesh coordinates (pp, dp, cp,
ep) with r = ((pp * DP + dp) * CP + cp) * EP + ep, so expert-parallel peers are neighbouring ranks (the all-to-all
stays inside a node) and pipeline stages are farthest apart. With dp_replicate R (HSDP) the data-parallel ranks
are R replicas of DP / R shards, dp = replica * (DP / R) + shard: a replica's shards, with their cp and ep ranks,
are consecutive ranks, one node under torchrun's rank order when they number its GPUs, so FSDP's all-gathers and
reduce-scatters stay inside it and only the replicas' all-reduce of gradients crosses nodes. A rank whose wait for the
others times out says what it waited in (timed_out_line).
"""
import contextlib
import pickle
import traceback
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "cp", "ep")
HSDP_DIMS = ("pp", "dr", "ds", "cp", "ep")   # dp as replicas x shards
GROUPS = (("pp",), ("cp",), ("ep",), ("dp", "cp"), ("dp", "cp", "ep"))   # Parallel.group's callers' (and FSDP's)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class LayoutError(ValueError):
    """A parallel layout that cannot work for this world or this model; the message says why."""


@dataclass(frozen=True)
class Parallel:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    rank: int = 0
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)   # None on one process
    dp_replicate: int = 1
    replicas: DeviceMesh | None = field(default=None, compare=False, repr=False)   # (pp, dr, ds, cp, ep), for HSDP

    @classmethod
    def build(cls, pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1, device_type: str = "cpu",
              dp_replicate: int = 1) -> "Parallel":
        """The layout of the current process group (one process when torch.distributed is not initialized), with
        its device mesh (gloo on "cpu", NCCL on "cuda", whose device each process must have set)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        sizes = dict(pp=pp, dp=dp, cp=cp, ep=ep, dp_replicate=dp_replicate)
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"--{name.replace('_', '-')}={size!r} must be a positive integer")
        if dp % dp_replicate:
            raise LayoutError(f"--dp-replicate {dp_replicate} must divide --dp {dp} (the data-parallel ranks are "
                              f"replicas of dp / dp-replicate shards); choose one of {divisors(dp)}")
        if pp * dp * cp * ep != world:
            raise LayoutError(f"pp x dp x cp x ep = {pp} x {dp} x {cp} x {ep} = {pp * dp * cp * ep}, but the world has "
                              f"{world} processes; choose sizes whose product is {world}")
        if world == 1:
            return cls(pp, dp, cp, ep)
        mesh = init_device_mesh(device_type, (pp, dp, cp, ep), mesh_dim_names=DIMS)
        replicas = None if dp_replicate == 1 else init_device_mesh(   # the same ranks, dp cut into replicas x shards
            device_type, (pp, dp_replicate, dp // dp_replicate, cp, ep), mesh_dim_names=HSDP_DIMS)
        parallel = cls(pp, dp, cp, ep, dist.get_rank(), mesh, dp_replicate, replicas)
        for names in GROUPS:   # every group the engine uses, made now in one order on every rank (NCCL: eagerly)
            parallel.group(*names)
        if parallel.sharded:
            parallel.shard_mesh("dp", "cp"), parallel.shard_mesh("dp", "cp", "ep")
        if dp_replicate > 1 and parallel.replica_size > 1:
            parallel.norm_group()
        return parallel

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.ep

    @property
    def sharded(self) -> bool:
        """Whether FSDP shards the weights: other ranks share this one's pipeline stage (dp x cp x ep > 1)."""
        return self.world > self.pp

    @property
    def data_rank(self) -> int:
        """Which share of each global batch this rank reads: ep ranks read different data, cp ranks share it."""
        return self.coords["dp"] * self.ep + self.coords["ep"]

    @property
    def data_ranks(self) -> int:
        return self.dp * self.ep

    def mesh_over(self, *names: str) -> DeviceMesh:
        """The 1-d mesh of this rank's group over the named dimensions (for FSDP and DTensors)."""
        if self.mesh is None:
            raise LayoutError(f"{self} has no device mesh; build it with Parallel.build() inside an initialized "
                              "process group (torchrun) to use its groups")
        sub = self.mesh[names]
        return sub._flatten("_".join(names)) if len(names) > 1 else sub

    def shard_mesh(self, *names: str) -> DeviceMesh:
        """The mesh FSDP shards over for the named dimensions (dp first): them flattened into one (full sharding),
        or under dp_replicate R a 2-d mesh, R replicas by the rest flattened (HSDP: shard within a replica,
        all-reduce the gradients across replicas)."""
        if self.dp_replicate == 1:
            return self.mesh_over(*names)
        inner = ("ds", *names[1:])
        self.replicas[inner]._flatten("_".join(inner))
        return self.replicas["dr", "_".join(inner)]

    @property
    def replica_size(self) -> int:
        """The ranks that hold every gradient element once between them: the world, or under HSDP one replica."""
        return self.world // self.dp_replicate

    def norm_group(self):
        """The process group of replica_size ranks this rank is one of (None: the world); for replica_size > 1."""
        if self.dp_replicate == 1:
            return None
        names = tuple(name for name in ("pp", "ds", "cp", "ep") if self.replicas[name].size() > 1)
        return self.replicas[names]._flatten("_".join(names)).get_group()

    def group(self, *names: str):
        """This rank's process group over the named dimensions; None when the group is this rank alone."""
        if prod(getattr(self, name) for name in names) == 1:
            return None
        return self.mesh_over(*names).get_group()

    @property
    def coords(self) -> dict[str, int]:
        """This rank's position on each mesh dimension."""
        rest, coords = self.rank, {}
        for name in reversed(DIMS):
            rest, coords[name] = divmod(rest, getattr(self, name))
        return {name: coords[name] for name in DIMS}

    def ranks_along(self, *names: str) -> list[int]:
        """The ranks that differ from this one only along the named dimensions (its group over them)."""
        sizes = [getattr(self, name) for name in DIMS]
        coords = self.coords
        ranks = [0]
        for name, size in zip(DIMS, sizes):
            choices = range(size) if name in names else [coords[name]]
            ranks = [r * size + c for r in ranks for c in choices]
        return ranks

    def check_model(self, num_layers: int, num_experts: int, seq_len: int):
        """Errors for a layout this model cannot be cut into."""
        if num_experts % self.ep:
            raise LayoutError(f"num_experts={num_experts} cannot be split over ep={self.ep} ranks; "
                              f"choose ep dividing {num_experts}")
        if self.pp > 1 and num_layers < 2 * self.pp:
            raise LayoutError(f"num_hidden_layers={num_layers} is fewer than the 2 x pp = {2 * self.pp} pipeline chunks "
                              f"DualPipeV needs; choose pp <= {num_layers // 2}")
        if self.cp > 1 and seq_len % (2 * self.cp):   # one rank holds the whole sequence: any length
            raise LayoutError(f"seq_len={seq_len} must be divisible by 2 x cp = {2 * self.cp} "
                              f"(each context-parallel rank holds two chunks)")


def timed_out_line(err: RuntimeError, seconds: float, trace: Path) -> str:
    """The line of a rank whose wait timed out: the operation (the torch.distributed call under the innermost line of
    Pith's code in the traceback; for a wait on work issued earlier, the last collective the flight recorder holds),
    its group's ranks and that line. The recorder's collectives (as NCCL's watchdog writes them) go to
    trace/rank_<rank> (the app's: <out>/comm-trace)."""
    op = group = None
    site = "?"
    for frame, line in traceback.walk_tb(err.__traceback__):
        file, code = frame.f_code.co_filename, frame.f_code.co_name
        if "/pith_" in file:
            op, group, site = None, None, f"{Path(file).name}:{line} ({code})"
        elif file.endswith("distributed_c10d.py") and op is None:
            ops = frame.f_locals.get("p2p_op_list") or [None]
            op, group = code, frame.f_locals.get("group") or getattr(ops[0], "group", None)
    rank, recent = dist.get_rank(), None
    with contextlib.suppress(OSError, RuntimeError, KeyError):
        recent = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        ranks = lambda name: str(dist.get_process_group_ranks(c10d._resolve_process_group(name)))
        recent["pg_config"] = {name: dict(name=name, desc=desc, ranks=ranks(name))   # (gloo's are empty; torchfrtrace
                               for name, desc in {e["process_group"] for e in recent["entries"]}}   # reads them)
        trace.mkdir(parents=True, exist_ok=True)
        (trace / f"rank_{rank}").write_bytes(pickle.dumps(recent))
    if op is None and recent and recent["entries"]:
        last = recent["entries"][-1]
        op, group = last["profiling_name"].split(":")[-1], c10d._resolve_process_group(last["process_group"][0])
    what = f"{op} with ranks {dist.get_process_group_ranks(group or dist.group.WORLD)}" if op else "a wait"
    return (f"rank {rank} waited {seconds:g} s (--dist-timeout) in {what} at {site}: a rank it waits for is stuck or "
            f"gone; its recent collectives are in {trace / f'rank_{rank}'} (skills/pith-apps/launch/SKILL.md reads "
            "them); the last checkpoint is intact")
