"""Communication order under NCCL's rules, checked on gloo.

gloo buffers a send and runs each collective on the host, so an order of communication that NCCL cannot finish
passes on CPU. `Recorder` records what a process issues while the real code runs (every batch_isend_irecv, send,
recv and collective, by process group, in issue order, from every thread; torch's own calls too, FSDP2's gathers and
reduce-scatters and DCP's object collectives, which reach torch.distributed through its module attributes) and where
it waited for each: each op's shapes and dtype, a fingerprint of what a send sent (at issue) and of what a receive
or a broadcast got (when it is done). `replay` then runs the traces of all ranks as NCCL would:
- the ops of one communicator (process group) on a rank run one after another in issue order (one stream);
- an op issued after the rank waited for another starts only once that one is done (the wait orders the compute
  stream, and the next op's stream waits for the compute stream);
- a batch of sends and receives runs as one: it is done when each of its sends and receives has met its partner
  (the k-th send from a to b on a communicator meets the k-th receive on b from a), and the two meet only while
  both their ops run: a send never completes before its receive has started, whatever its size;
- a collective is done when every member of its group has started the same collective as its n-th.
Both sides of every match must agree: a send and its receive on shape, dtype and fingerprint (another fingerprint:
the message gloo delivered there is not the one NCCL's order delivers), a collective's members on its kind, the
pipeline step that issued it (tag), shapes, dtype, reduction and root, and a broadcast's members on what they got.
Two ranks must also issue the ops of two communicators that both are in in the same order: on a GPU, NCCL can
deadlock on opposite orders (each GPU may run its first kernel alone, which waits for the other's).
`replay` returns None when everything completes, else one report: a mismatch (naming both sides), a send no one
receives, a collective one rank never issues, the cycle of waits that NCCL would hang in, or two ranks' crossed
communicators, with the ranks, ops and the lines that issued them.
"""
import inspect
import math
import pickle
import sys
import threading
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "barrier", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list")


@dataclass
class Op:
    rank: int
    index: int              # its place among the rank's ops
    comm: str               # the process group's name
    kind: str               # "p2p" or the collective's function name
    parts: list = field(default_factory=list)   # p2p: ("send" | "recv", peer's global rank, shape, dtype, fingerprint)
    sizes: tuple = ()       # what every member of a collective must agree on; all_to_all_single: rows per rank
    members: tuple = ()     # a collective: its group's global ranks
    waits: list = field(default_factory=list)   # ops this rank waited for after issuing the previous op
    site: str = ""          # the line that issued it, innermost of Pith's packages (_site)
    tag: object = None      # what the test says was running (a pipeline step); collectives must agree on it
    content: str = None     # a broadcast: the fingerprint of what it left on this rank, once done
    stack: tuple = ()       # every line of Pith's packages on the stack, innermost first

    def __post_init__(self):   # a part given without its fingerprint: unknown
        self.parts = [tuple(part) + (None,) * (5 - len(part)) for part in self.parts]

    def __str__(self):
        what = ", ".join(f"{kind} {'to' if kind == 'send' else 'from'} {peer} ({shape}, {dtype}"
                         f"{f', #{print_}' if print_ else ''})" for kind, peer, shape, dtype, print_ in self.parts) \
            if self.kind == "p2p" else f"{self.kind} {self.sizes}{f' #{self.content}' if self.content else ''}"
        tag, site = f" [{self.tag}]" if self.tag is not None else "", f" at {self.site}" if self.site else ""
        return f"rank {self.rank} op {self.index} (group {self.comm}): {what}{tag}{site}"


def fingerprint(tensor: torch.Tensor) -> str:
    """The sum of a tensor's bytes and their sum weighted by position (1, 2, ...), each mod 2^32, in hex: integer
    sums, exact whatever order they are added in, so equal contents always give the same print."""
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).to(torch.int64)
    weighted = data * torch.arange(1, data.numel() + 1, device=data.device)
    return f"{int(data.sum()) % 2 ** 32:08x}{int(weighted.sum()) % 2 ** 32:08x}"


def _line(frame) -> str:
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"


def _site() -> tuple[str, tuple]:
    """(site, stack): the innermost line of pith_* code on the stack (else the first outside this file and torch),
    then "<" the innermost in another file (what the helper served) and "via" the line of torch that made the call
    where torch did (FSDP2, DCP); and every pith_* line, innermost first."""
    frame, caller, outside, stack = sys._getframe(1), None, None, []
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.endswith("/comm_order.py"):
            caller = caller or frame
            if "/pith_" in name:
                stack.append(_line(frame))
            elif outside is None and "/torch/" not in name:
                outside = _line(frame)
        frame = frame.f_back
    site = stack[0] if stack else outside or "?"
    site += next((f" < {line}" for line in stack if line.split(":")[0] != site.split(":")[0]), "")
    via = f" via {_line(caller)}" if caller is not None and "/torch/" in caller.f_code.co_filename else ""
    return site + via, tuple(stack)


def _group(group):
    return group or c10d._get_default_group()


def _arrived(p: int, tensor: torch.Tensor):
    """What fills in part p's fingerprint once the receive is done."""
    def done(op):
        op.parts[p] = op.parts[p][:4] + (fingerprint(tensor),)
    return done


def _describe(name: str, arguments: dict) -> tuple[dict, list]:
    """An op's fields from the arguments of the call that issues it, and what fills in the rest once it is done:
    functions of the op, one for each part of a batch (None: nothing), else one."""
    if name == "batch_isend_irecv":
        ops = arguments["p2p_op_list"]
        kinds = [op.op.__name__[1:] for op in ops]
        return dict(comm=_group(ops[0].group).group_name, kind="p2p",
                    parts=[(kind, op.peer, tuple(op.tensor.shape), str(op.tensor.dtype),
                            fingerprint(op.tensor) if kind == "send" else None) for kind, op in zip(kinds, ops)]), \
            [_arrived(p, op.tensor) if kind == "recv" else None for p, (kind, op) in enumerate(zip(kinds, ops))]
    group = arguments.get("group")
    if name == "funcol_all_reduce":
        group = c10d._resolve_process_group(funcol._resolve_group_name(group))
    group = _group(group)
    if name in ("send", "recv"):
        tensor, peer = arguments["tensor"], arguments.get("dst", arguments.get("src"))
        part = (name, peer, tuple(tensor.shape), str(tensor.dtype), fingerprint(tensor) if name == "send" else None)
        return dict(comm=group.group_name, kind="p2p", parts=[part]), [_arrived(0, tensor) if name == "recv" else None]
    members, done = tuple(dist.get_process_group_ranks(group)), None
    if name == "all_to_all_single":
        out, inp = arguments["output"], arguments["input"]
        row = (tuple(inp.shape[1:]), str(inp.dtype))
        # rows taken from and sent to each member, in group order (None: an even split)
        taken = arguments.get("output_split_sizes") or [out.shape[0] // len(members)] * len(members)
        sent = arguments.get("input_split_sizes") or [inp.shape[0] // len(members)] * len(members)
        sizes = (row, tuple(taken), tuple(sent))
    elif name in ("broadcast_object_list", "gather_object", "scatter_object_list", "all_gather_object", "barrier"):
        # the root, and the number of objects a broadcast carries
        root = next((arguments[k] for k in ("src", "dst") if arguments.get(k) is not None), None)
        if root is None and (local := arguments.get("group_src", arguments.get("group_dst"))) is not None:
            root = dist.get_global_rank(group, local)
        objects = arguments["object_list"] if name == "broadcast_object_list" else None
        sizes = (root,) if objects is None else (root, len(objects))
        if objects is not None:
            def done(op):
                op.content = fingerprint(torch.frombuffer(bytearray(pickle.dumps(objects)), dtype=torch.uint8))
    else:   # the shapes of its input and output, the dtype, the reduction and the root
        tensor = next(arguments[k] for k in ("input_tensor", "input", "tensor", "self") if k in arguments)
        out = arguments.get("output_tensor", arguments.get("output", arguments.get("tensor_list")))
        out = [tuple(t.shape) for t in out] if isinstance(out, list) else out if out is None else tuple(out.shape)
        op = arguments.get("op", arguments.get("reduceOp"))
        op = getattr(op, "name", op if op is None or isinstance(op, str) else type(op).__name__)
        sizes = (tuple(tensor.shape), str(tensor.dtype), out, op, arguments.get("src"))
        if name == "broadcast":
            def done(op):
                op.content = fingerprint(tensor)
    return dict(comm=group.group_name, kind=name, sizes=sizes, members=members), [done]


class _Waiting:
    """A work whose wait() is recorded (and, once it returns, what its op got); everything else passes through."""

    def __init__(self, work, recorder, op, done: list):
        self._work, self._recorder, self._op, self._done = work, recorder, op, done

    def wait(self, *args, **kwargs):
        self._recorder.waited(self._op)
        result = self._work.wait(*args, **kwargs)
        self._recorder.finished(self._op, self._done)
        return result

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

    def finished(self, op: Op, done: list):
        with self.lock:
            for fill in done:
                if fill is not None:
                    fill(op)

    def _issue(self, fields: dict) -> Op:
        site, stack = _site()
        with self.lock:
            op = Op(self.rank, len(self.ops), waits=self.new_waits, site=site, stack=stack,
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
            bound.apply_defaults()   # a default reduction agrees with one named
            fields, done = _describe(name, bound.arguments)
            op = self._issue(fields)
            self.inside.call = True
            try:
                result = real(*args, **kwargs)
            finally:
                self.inside.call = False
            if name == "batch_isend_irecv":   # gloo: a work for each op; NCCL's coalesced batch: one for all
                each = [[fill] for fill in done] if len(result) == len(done) else [done] * len(result)
                return [_Waiting(work, self, op, fills) for work, fills in zip(result, each)]
            if bound.arguments.get("async_op") and result is not None:
                return _Waiting(result, self, op, done)
            self.waited(op)   # a blocking call (or a functional collective, taken as waited at once)
            self.finished(op, done)
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


def without(traces: dict[int, list[Op]], rank: int, index: int) -> dict[int, list[Op]]:
    """The traces with op `index` of `rank` left out (as if that rank had never issued it), the others renumbered."""
    def moved(i):
        return i - (i > index)
    ops = [replace(op, index=moved(op.index), waits=[moved(w) for w in op.waits if w != index])
           for op in traces[rank] if op.index != index]
    return traces | {rank: ops}


def _match_p2p(traces):
    """{(rank, op, part): the partner's (rank, op)}, or a report of the first mismatch."""
    sends, recvs = {}, {}
    for rank, ops in traces.items():
        for op in ops:
            for p, (kind, peer, *_) in enumerate(op.parts):
                pair = (op.comm, rank, peer) if kind == "send" else (op.comm, peer, rank)
                (sends if kind == "send" else recvs).setdefault(pair, []).append((rank, op.index, p))
    partners = {}
    for pair in sorted(sends.keys() | recvs.keys()):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(out), len(into))):
            if k >= len(out) or k >= len(into):
                lone, what = (out[k], "send") if k < len(out) else (into[k], "receive")
                return f"{traces[lone[0]][lone[1]]}: its {what} (#{k} from rank {pair[1]} to rank {pair[2]}) has " \
                       "no partner, which NCCL would wait for forever"
            s, r = out[k], into[k]
            sent, got = traces[s[0]][s[1]].parts[s[2]][2:], traces[r[0]][r[1]].parts[r[2]][2:]
            differ = [f"{what} {a} sent, {b} received" for what, a, b in
                      zip(("shape", "dtype", "fingerprint"), sent, got) if a != b and None not in (a, b)]
            if differ:
                return f"send #{k} from rank {pair[1]} to rank {pair[2]} (group {pair[0]}) does not match its " \
                       f"receive: {'; '.join(differ)}\n  {traces[s[0]][s[1]]}\n  {traces[r[0]][r[1]]}"
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
        if None not in (op.content, first.content) and op.content != first.content:
            return f"{first}\n  but {op}\n  left other contents"
    if first.kind == "all_to_all_single":
        for i, a in enumerate(members):
            for j, b in enumerate(members):
                sent, taken = nth[a].sizes[2][j], nth[b].sizes[1][i]
                if sent != taken:
                    return f"{nth[a]} sends {sent} rows to rank {b}\n  but {nth[b]} takes {taken} from rank {a}"
    return None


def _lacking(comm: str, by_rank: dict[int, list[Op]]) -> str | None:
    """Where a member issued fewer collectives on a group than another: the report that it lacks the other's first
    one whose kind, tag, stack or sizes it does not match, when it ran out there or its own there is the other's
    next (else None)."""
    def key(op):
        return op.kind, op.tag, op.stack, op.sizes[:1] if op.kind == "all_to_all_single" else op.sizes
    for a, theirs in by_rank.items():
        for b, mine in by_rank.items():
            if len(mine) >= len(theirs):
                continue
            n = next(n for n in range(len(theirs)) if n >= len(mine) or key(theirs[n]) != key(mine[n]))
            if n == len(mine) or key(theirs[n + 1]) == key(mine[n]):
                later = f"its #{n} there is the other's #{n + 1}:\n  {mine[n]}" if n < len(mine) else \
                    f"it issues {len(mine)} there"
                return f"rank {b} never issues collective #{n} of group {comm} (ranks {list(by_rank)}), which NCCL " \
                       f"would wait for forever:\n  {theirs[n]}\n  ({later})"
    return None


def _match_collectives(traces):
    """{(rank, op): every member's (rank, op) of that collective}, or a report of the first mismatch."""
    calls = {}
    for rank, ops in traces.items():
        for op in ops:
            if op.kind != "p2p":
                calls.setdefault((op.comm, op.members), {}).setdefault(rank, []).append(op)
    peers = {}
    for (comm, members), found in sorted(calls.items()):
        by_rank = {rank: found.get(rank, []) for rank in members}
        counts = {rank: len(ops) for rank, ops in by_rank.items()}
        if len(set(counts.values())) > 1 and (report := _lacking(comm, by_rank)):
            return report
        for n in range(max(counts.values())):
            if min(counts.values()) == n:
                fewest, most = min(counts, key=counts.get), max(counts, key=counts.get)
                return f"group {comm} (ranks {list(members)}) runs {counts} collectives per rank: rank {fewest} " \
                       f"never reaches {by_rank[most][n]}"
            if problem := _agree({rank: ops[n] for rank, ops in by_rank.items()}):
                return f"collective #{n} of group {comm} differs between ranks:\n  {problem}"
            for op in (ops[n] for ops in by_rank.values()):
                peers[op.rank, op.index] = [(ops[n].rank, ops[n].index) for ops in by_rank.values()]
    return peers


def _crossed(traces, partners, peers) -> str | None:
    """Two ranks whose ops on two groups they are both in run in opposite orders: a report, else None."""
    shared = {}   # (rank, other rank) -> (op of rank, its partner or fellow member on the other)
    for (rank, index, _), (other, there) in partners.items():
        shared.setdefault((rank, other), set()).add((index, there))
    for (rank, index), members in peers.items():
        for other, there in members:
            shared.setdefault((rank, other), set()).add((index, there))
    for (rank, other), pairs in sorted(shared.items()):
        if rank >= other:   # the same pairs as (other, rank)
            continue
        latest = {}   # group -> the pair whose op on the other rank came last, of this rank's so far on that group
        for index, there in sorted(pairs):
            comm = traces[rank][index].comm
            for earlier, (i, t) in latest.items():
                if earlier != comm and t > there:
                    a, b, x, y = traces[rank][i], traces[rank][index], traces[other][there], traces[other][t]
                    return f"ranks {rank} and {other} issue the ops of two groups they are both in in opposite " \
                           "orders, which NCCL can deadlock on (each GPU may run its first kernel alone, which " \
                           f"waits for the other's):\n  {a}\n    before {b}\n  but {x}\n    before {y}"
            if latest.get(comm, (0, -1))[1] < there:
                latest[comm] = (index, there)
    return None


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
    return _crossed(traces, partners, peers) if run.run() else run.stuck()
