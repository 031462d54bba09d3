"""Communication order under NCCL's rules, checked on gloo.

gloo buffers a send and runs each collective on the host, so an order of communication that NCCL cannot finish
passes on CPU. `Recorder` records what a process issues while the real code runs (every batch_isend_irecv, send,
recv and collective, by process group, in issue order, from every thread) and where it waited for each; `replay`
then runs the traces of all ranks as NCCL would:
- the ops of one communicator (process group) on a rank run one after another in issue order (one stream);
- an op issued after the rank waited for another starts only once that one is done (the wait orders the compute
  stream, and the next op's stream waits for the compute stream);
- a batch of sends and receives runs as one: it is done when each of its sends and receives has met its partner
  (the k-th send from a to b on a communicator meets the k-th receive on b from a), and the two meet only while
  both their ops run: a send never completes before its receive has started, whatever its size;
- a collective is done when every member of its group has started the same collective (kind, sizes) as its n-th.
`replay` returns None when everything completes, else one report: a mismatch (sizes, kinds, a send no one receives)
or the cycle of waits that NCCL would hang in, with the ranks, ops and the lines that issued them.
"""
import inspect
import math
import sys
import threading
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "barrier", "all_gather_object",
               "broadcast_object_list")


@dataclass
class Op:
    rank: int
    index: int              # its place among the rank's ops
    comm: str               # the process group's name
    kind: str               # "p2p" or the collective's function name
    parts: list = field(default_factory=list)   # p2p: ("send" | "recv", peer's global rank, numel, dtype)
    sizes: tuple = ()       # a collective's sizes, which every member must agree on; all_to_all_single: per rank
    members: tuple = ()     # a collective: its group's global ranks
    waits: list = field(default_factory=list)   # ops this rank waited for after issuing the previous op
    site: str = ""          # the innermost line of Pith's packages that issued it
    tag: object = None      # what the test says was running (a pipeline step); collectives must agree on it

    def __str__(self):
        what = ", ".join(f"{kind} {'to' if kind == 'send' else 'from'} {peer} ({n} x {dtype})"
                         for kind, peer, n, dtype in self.parts) if self.kind == "p2p" else f"{self.kind} {self.sizes}"
        tag, site = f" [{self.tag}]" if self.tag is not None else "", f" at {self.site}" if self.site else ""
        return f"rank {self.rank} op {self.index} (group {self.comm}): {what}{tag}{site}"


def _site() -> str:
    """The innermost frame of pith_* code on the stack, else the first caller outside this file and torch."""
    frame, outside = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/pith_" in name:
            return f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        if outside is None and not name.endswith("/comm_order.py") and "/torch/" not in name:
            outside = f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return outside or "?"


def _group(group):
    return group or c10d._get_default_group()


def _describe(name: str, arguments: dict) -> dict:
    """An op's fields from the arguments of the call that issues it."""
    if name == "batch_isend_irecv":
        ops = arguments["p2p_op_list"]
        return dict(comm=_group(ops[0].group).group_name, kind="p2p",
                    parts=[(op.op.__name__[1:], op.peer, op.tensor.numel(), str(op.tensor.dtype)) for op in ops])
    group = arguments.get("group")
    if name == "funcol_all_reduce":
        group = c10d._resolve_process_group(funcol._resolve_group_name(group))
    group = _group(group)
    if name in ("send", "recv"):
        tensor, peer = arguments["tensor"], arguments.get("dst", arguments.get("src"))
        return dict(comm=group.group_name, kind="p2p", parts=[(name, peer, tensor.numel(), str(tensor.dtype))])
    members, tensor = tuple(dist.get_process_group_ranks(group)), arguments.get("input", arguments.get("tensor"))
    if name == "all_to_all_single":
        out, inp = arguments["output"], arguments["input"]
        row = (math.prod(inp.shape[1:]), str(inp.dtype))
        # rows taken from and sent to each member, in group order (None: an even split)
        taken = arguments.get("output_split_sizes") or [out.shape[0] // len(members)] * len(members)
        sent = arguments.get("input_split_sizes") or [inp.shape[0] // len(members)] * len(members)
        sizes = (row, tuple(taken), tuple(sent))
    elif name in ("all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                  "reduce_scatter_tensor") or tensor is not None:
        tensor = arguments.get("input_tensor", arguments.get("input", tensor))
        sizes = (tensor.numel(), str(tensor.dtype))
    else:   # barrier and the object collectives: their sizes are their own business
        sizes = ()
    return dict(comm=group.group_name, kind=name, sizes=sizes, members=members)


class _Waiting:
    """A work whose wait() is recorded; everything else passes through."""

    def __init__(self, work, recorder, op):
        self._work, self._recorder, self._op = work, recorder, op

    def wait(self, *args, **kwargs):
        self._recorder.waited(self._op)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class Recorder:
    """Inside `with Recorder(tag) as recorder:`, every communication this process issues is kept in recorder.ops;
    tag() (optional) names what the calling thread runs, e.g. its pipeline step."""

    def __init__(self, tag=None):
        self.tag, self.ops, self.rank = tag, [], dist.get_rank()
        self.new_waits, self.lock, self.inside = [], threading.RLock(), threading.local()

    def waited(self, op: Op):
        with self.lock:
            self.new_waits.append(op.index)

    def _issue(self, fields: dict) -> Op:
        with self.lock:
            op = Op(self.rank, len(self.ops), waits=self.new_waits, site=_site(),
                    tag=self.tag() if self.tag else None, **fields)
            self.new_waits = []
            self.ops.append(op)
        return op

    def _wrap(self, name: str, real):
        signature = inspect.signature(real)

        def recorded(*args, **kwargs):
            if getattr(self.inside, "call", False):   # inside another recorded call (all_gather_object's all_gather)
                return real(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            op = self._issue(_describe(name, bound.arguments))
            self.inside.call = True
            try:
                result = real(*args, **kwargs)
            finally:
                self.inside.call = False
            if name == "batch_isend_irecv":
                return [_Waiting(work, self, op) for work in result]
            if bound.arguments.get("async_op") and result is not None:
                return _Waiting(result, self, op)
            self.waited(op)   # a blocking call (or a functional collective, taken as waited at once)
            return result
        return recorded

    def __enter__(self):
        self.patched = [(module, name, getattr(module, name)) for name in ("batch_isend_irecv", "send", "recv",
                                                                          *COLLECTIVES) for module in (dist, c10d)]
        for name in ("batch_isend_irecv", "send", "recv", *COLLECTIVES):
            setattr(dist, name, wrapped := self._wrap(name, getattr(c10d, name)))
            setattr(c10d, name, wrapped)
        self.patched.append((funcol, "all_reduce", funcol.all_reduce))
        funcol.all_reduce = self._wrap("funcol_all_reduce", funcol.all_reduce)
        return self

    def __exit__(self, *exc):
        for module, name, real in reversed(self.patched):
            setattr(module, name, real)

    def gathered(self) -> dict[int, list[Op]]:
        """Every rank's ops (a collective over the default group: call it on every rank, after recording)."""
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.ops)
        return dict(enumerate(every))


def _match_p2p(traces):
    """{(rank, op, part): the partner's (rank, op)}, or a report of the first mismatch."""
    sends, recvs = {}, {}
    for rank, ops in traces.items():
        for op in ops:
            for p, (kind, peer, n, dtype) in enumerate(op.parts):
                pair = (op.comm, rank, peer) if kind == "send" else (op.comm, peer, rank)
                (sends if kind == "send" else recvs).setdefault(pair, []).append((rank, op.index, p, n, dtype))
    partners = {}
    for pair in sorted(sends.keys() | recvs.keys()):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(out), len(into))):
            if k >= len(out) or k >= len(into):
                lone, what = (out[k], "send") if k < len(out) else (into[k], "receive")
                return f"{traces[lone[0]][lone[1]]}: its {what} (#{k} from rank {pair[1]} to rank {pair[2]}) has " \
                       "no partner, which NCCL would wait for forever"
            s, r = out[k], into[k]
            if s[3:] != r[3:]:
                return f"send #{k} from rank {pair[1]} to rank {pair[2]} is {s[3]} x {s[4]} but its receive is " \
                       f"{r[3]} x {r[4]}: {traces[s[0]][s[1]]}; {traces[r[0]][r[1]]}"
            partners[s[:3]], partners[r[:3]] = r[:2], s[:2]
    return partners


def _agree(nth: dict[int, Op]) -> str | None:
    """Why one group's n-th collectives (member -> op) differ, or None."""
    members = sorted(nth)
    first = nth[members[0]]
    for op in nth.values():
        if op.kind != first.kind or op.tag != first.tag or (op.sizes != first.sizes and op.kind != "all_to_all_single"
                                                            or op.sizes[:1] != first.sizes[:1]):
            return f"{first}\n  but {op}"
    if first.kind == "all_to_all_single":
        for i, a in enumerate(members):
            for j, b in enumerate(members):
                sent, taken = nth[a].sizes[2][j], nth[b].sizes[1][i]
                if sent != taken:
                    return f"{nth[a]} sends {sent} rows to rank {b}\n  but {nth[b]} takes {taken} from rank {a}"
    return None


def _match_collectives(traces):
    """{(rank, op): every member's (rank, op) of that collective}, or a report of the first mismatch."""
    calls = {}
    for rank, ops in traces.items():
        for op in ops:
            if op.kind != "p2p":
                calls.setdefault((op.comm, op.members), {}).setdefault(rank, []).append(op)
    peers = {}
    for (comm, members), by_rank in sorted(calls.items()):
        counts = {rank: len(by_rank.get(rank, [])) for rank in members}
        if len(set(counts.values())) > 1:
            fewest, most = min(counts, key=counts.get), max(counts, key=counts.get)
            return f"group {comm} (ranks {list(members)}) runs {counts} collectives per rank: rank {fewest} never " \
                   f"reaches {by_rank[most][counts[fewest]]}"
        for n in range(counts[members[0]]):
            nth = {rank: by_rank[rank][n] for rank in members}
            if problem := _agree(nth):
                return f"collective #{n} of group {comm} differs between ranks:\n  {problem}"
            for op in nth.values():
                peers[op.rank, op.index] = [(other.rank, other.index) for other in nth.values()]
    return peers


class _Replay:
    """The traces run as NCCL would (the module's rules); `stuck` says why what did not complete waits."""

    def __init__(self, traces, partners, peers):
        self.traces, self.partners, self.peers, self.done = traces, partners, peers, set()
        self.queues = {}   # (rank, group) -> its ops in issue order; only the first not done can run
        for rank, ops in traces.items():
            for op in ops:
                self.queues.setdefault((rank, op.comm), []).append(op.index)
        self.heads = dict.fromkeys(self.queues, 0)
        self.waits_done = dict.fromkeys(traces, 0)   # per rank: ops before this one have all their waits done

    def ready(self, key) -> bool:
        rank, index = key
        queue = self.queues[rank, self.traces[rank][index].comm]
        head = self.heads[rank, self.traces[rank][index].comm]
        return head < len(queue) and queue[head] == index and index < self.waits_done[rank]

    def met(self, key) -> bool:
        """Every partner (member) of op `key` runs or ran."""
        op = self.traces[key[0]][key[1]]
        others = ([self.partners[(*key, p)] for p in range(len(op.parts))] if op.kind == "p2p"
                  else self.peers[key])
        return all(other in self.done or self.ready(other) for other in others)

    def run(self) -> bool:
        progress = True
        while progress:
            progress = False
            for rank, ops in self.traces.items():
                while self.waits_done[rank] < len(ops) and all(
                        (rank, w) in self.done for w in ops[self.waits_done[rank]].waits):
                    self.waits_done[rank] += 1
            for (rank, comm), queue in self.queues.items():
                head = self.heads[rank, comm]
                if head < len(queue) and self.ready((rank, queue[head])) and self.met((rank, queue[head])):
                    self.done.add((rank, queue[head]))
                    self.heads[rank, comm] += 1
                    progress = True
        return len(self.done) == sum(len(ops) for ops in self.traces.values())

    def blocker(self, key):
        """(an op that stuck op `key` waits for, how)."""
        rank, index = key
        op = self.traces[rank][index]
        queue, head = self.queues[rank, op.comm], self.heads[rank, op.comm]
        if queue[head] != index:
            return (rank, queue[head]), "is queued on its group behind"
        if index >= self.waits_done[rank]:
            first = self.traces[rank][self.waits_done[rank]]
            return (rank, next(w for w in first.waits if (rank, w) not in self.done)), "was issued after a wait for"
        others = ([self.partners[(*key, p)] for p in range(len(op.parts))] if op.kind == "p2p" else self.peers[key])
        return next(o for o in others if o not in self.done and not self.ready(o)), "needs, and waits for,"

    def stuck(self) -> str:
        key = min((rank, queue[self.heads[rank, comm]]) for (rank, comm), queue in self.queues.items()
                  if self.heads[rank, comm] < len(queue))
        chain, seen = [], {}
        while key not in seen:
            seen[key] = len(chain)
            following, how = self.blocker(key)
            chain.append((key, how))
            key = following
        lines = [f"  {self.traces[k[0]][k[1]]}\n    {how}" for k, how in chain[seen[key]:]]
        return "NCCL would hang, in this cycle of waits:\n" + "\n".join(lines) + f"\n  {self.traces[key[0]][key[1]]}"


def replay(traces: dict[int, list[Op]]) -> str | None:
    """None when NCCL would complete every op of these traces ({rank: its ops}), else what would go wrong."""
    partners = _match_p2p(traces)
    if isinstance(partners, str):
        return partners
    peers = _match_collectives(traces)
    if isinstance(peers, str):
        return peers
    run = _Replay(traces, partners, peers)
    return None if run.run() else run.stuck()
