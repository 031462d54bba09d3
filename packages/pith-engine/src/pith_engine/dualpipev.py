"""DualPipeV: which forward, backward and weight-gradient steps each pipeline rank runs, in what order, and a
simulator of the resulting timeline.

The model is cut into 2P chunks for P pipeline ranks; rank r holds chunk r (phase 0) and chunk 2P-1-r (phase
1), a V: phase 0 flows from rank 0 to P-1, turns there without communication, and phase 1 flows back, so
rank 0 holds both the input and the loss. Each rank runs, for N >= 2P micro-batches, eight runs of steps
(the DeepSeek-V3 report; deepseek-ai/DualPipe), each phase seeing every micro-batch forward and backward once
and in order. A backward may leave its weight gradients for a later W step (zero-bubble), which runs the oldest
one left. Two steps in one tuple are an overlapped pair: one micro-batch's forward interleaved with another's
backward, so that each one's communication hides behind the other's computation.

`Pipeline` runs the schedule: a rank's two chunks (its layers from `chunk_layers`; a model built with only
`held_layers`, read through the engine's model contract) forward and backward, activations and their
gradients sent to the neighbouring ranks, each entry's receives in one batch with the previous entry's sends
(`exchanges`, the order deepseek-ai/DualPipe uses; the tests replay it under NCCL's rules); each chunk one call of
the model, which ComputeCasts or FSDP wrap.
With `defer_wgrad`, a deferring backward leaves its weight gradients (the expert stacks' and the eager dense
linears') to the W step that follows it in the schedule (`DeferredWeightGrads`); under FSDP the gradients are
then held unsharded through the step and reduce-scattered once at its end, after the last W step. With
`overlap`, a pair's forward runs in a thread of its own and the two take turns (`Turns`) at each all-to-all of
pith_engine.moe: one launches it and the other computes while it is in flight.

Run `python -m pith_engine.dualpipev --pp 4 --micro-batches 10` to print each rank's timeline and bubble.
"""
import argparse
import contextlib
import threading
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pith_engine import moe
from pith_engine.contract import MoeModel, wgrad_queue_holders
from pith_engine.data_parallel import fold_held_gradients, fsdp_modules, hold_gradients, reduce_held_gradients
from pith_engine.parallel import LayoutError, Parallel


@dataclass(frozen=True)
class Step:
    kind: str            # "F" forward, "B" backward (input and, unless deferred, weight gradients), "W"
    phase: int = 0       # F and B: 0 the rank's first chunk (r), 1 its second (2P-1-r)
    defer: bool = False  # B: leave the weight gradients to a W step


F0, F1, B0, B1, W = Step("F", 0), Step("F", 1), Step("B", 0), Step("B", 1), Step("W")


def schedule(pp: int, micro_batches: int, rank: int) -> list[tuple[Step, ...]]:
    """Pipeline rank `rank`'s steps in order; a tuple of two is an overlapped pair (forward, backward)."""
    if micro_batches < 2 * pp:
        raise LayoutError(f"DualPipeV needs at least 2 x pp = {2 * pp} micro-batches per step, not {micro_batches}; "
                          "raise --batch-size, lower --micro-batch-size (micro-batches: the batch size over micro-batch "
                          "size x data ranks) or lower --pp")
    before, after = pp - rank - 1, rank + 1   # ranks after this one, and this one with those before it
    steps = [(F0,)] * 2 * before + [(F0,), (F1,)] * after
    steps += [(Step("B", 1, True),), (W,), (F1,)] * before
    steps += [(F0, B1), (F1, B0)] * (micro_batches - 2 * pp + after)
    steps += [(B1,), (F1, B0)] * before
    last = [B1, B0] * after   # the second half defers, for the W steps that fill the drain
    steps += [(Step("B", s.phase, i >= after),) for i, s in enumerate(last)]
    steps += [(W,), (Step("B", 0, True),)] * before + [(W,)] * after
    return steps


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0     # one chunk, one micro-batch
    backward: float = 2.0    # input and weight gradients; deferred, it costs backward - weight
    weight: float = 1.0      # a W step
    overlapped: float = 2.5  # an overlapped (forward, backward) pair

    def of(self, steps: tuple[Step, ...]) -> float:
        if len(steps) == 2:
            return self.overlapped
        step = steps[0]
        return {"F": self.forward, "W": self.weight}.get(step.kind, self.backward - self.weight * step.defer)


def flow(step: Step) -> int:
    """+1 where the step's output goes to rank + 1 (phase 0's forward, phase 1's backward), else -1."""
    return 1 if (step.phase == 0) == (step.kind == "F") else -1


def numbered(plan: list[tuple[Step, ...]]):
    """(steps, the micro-batch of each) for each entry of a schedule: a phase's forwards, and its backwards, take
    the micro-batches in order; a W step has None."""
    taken = {}
    for steps in plan:
        batches = []
        for step in steps:
            key = (step.kind, step.phase)
            batches.append(None if step.kind == "W" else taken.get(key, 0))
            taken[key] = taken.get(key, 0) + 1
        yield steps, batches


def _needs(pp: int, rank: int, step: Step, micro_batch: int):
    """The (rank, kind, phase, micro-batch) whose end this step waits for; None for phase 0's first forward."""
    source = rank - flow(step)
    if 0 <= source < pp:
        return source, step.kind, step.phase, micro_batch
    if step.kind == "F":   # the embedding; or the turn of the V (phase 1 at rank P-1 after phase 0)
        return None if step.phase == 0 else (rank, "F", 0, micro_batch)
    return (rank, "F", 1, micro_batch) if step.phase == 1 else (rank, "B", 1, micro_batch)   # the loss; the turn


def simulate(pp: int, micro_batches: int, costs: Costs = Costs()):
    """Each rank's timeline [(start, end, steps)] and bubble (the last end minus the rank's busy time), with
    communication taken as free: a step starts once its rank is free and what it waits for has ended."""
    plans = [list(numbered(schedule(pp, micro_batches, rank))) for rank in range(pp)]
    ended, timelines = {}, [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for rank, plan in enumerate(plans):
            if len(timelines[rank]) == len(plan):
                continue
            steps, batches = plan[len(timelines[rank])]
            work = [(step, i) for step, i in zip(steps, batches) if i is not None]
            needs = [need for step, i in work if (need := _needs(pp, rank, step, i)) is not None]
            if any(need not in ended for need in needs):
                continue
            start = max([timelines[rank][-1][1] if timelines[rank] else 0.0, *(ended[need] for need in needs)])
            end = start + costs.of(steps)
            ended.update(((rank, step.kind, step.phase, i), end) for step, i in work)
            timelines[rank].append((start, end, steps))
            progress = True
    span = max(line[-1][1] for line in timelines)
    return timelines, [span - sum(end - start for start, end, _ in line) for line in timelines]


def chart(timelines, columns_per_unit: int = 4) -> str:
    """One text line per rank: F / f forward of phase 0 / 1, B / b backward, W weight step, X overlapped pair,
    . idle; columns_per_unit columns per unit of cost."""
    letters = {("F", 0): "F", ("F", 1): "f", ("B", 0): "B", ("B", 1): "b", ("W", 0): "W"}
    lines = []
    for rank, line in enumerate(timelines):
        text = ""
        for start, end, steps in line:
            text += "." * (round(start * columns_per_unit) - len(text))
            letter = "X" if len(steps) == 2 else letters[steps[0].kind, steps[0].phase]
            text += letter * (round(end * columns_per_unit) - len(text))
        lines.append(f"rank {rank}: {text}")
    return "\n".join(lines)


def chunk_layers(num_layers: int, pp: int, sizes: list[int] | None = None) -> list[range]:
    """The decoder layers of each of the 2pp chunks, in model order: `sizes` layers each, or as even as possible
    with the spare layers going to the chunks nearest the turn of the V (rank 0's chunks also embed and take
    the loss)."""
    chunks = 2 * pp
    if num_layers < chunks:
        raise LayoutError(f"{num_layers} layers cannot fill the 2 x pp = {chunks} chunks of DualPipeV (at least one "
                          f"layer each); lower pp to at most {num_layers // 2}")
    if sizes is None:
        base, spare = divmod(num_layers, chunks)
        nearest_turn = sorted(range(chunks), key=lambda c: abs(c - (chunks - 1) / 2))[:spare]
        sizes = [base + (c in nearest_turn) for c in range(chunks)]
    if len(sizes) != chunks or sum(sizes) != num_layers or min(sizes) < 1:
        raise LayoutError(f"layers per chunk {sizes} must be {chunks} positive counts (2 x pp) summing to the "
                          f"model's {num_layers} layers")
    starts = [sum(sizes[:c]) for c in range(chunks)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def held_layers(chunks: list[range], rank: int) -> list[int]:
    """The layers pipeline rank `rank` holds: those of its chunks rank and 2pp-1-rank (chunks: chunk_layers)."""
    return [*chunks[rank], *chunks[len(chunks) - 1 - rank]]


def sends(pp: int, micro_batches: int, rank: int) -> list[tuple[int, tuple]]:
    """(pipeline rank, message) for each send of this rank in order; a message is named by the step that
    sends it, (kind, phase, micro-batch). The turn of the V (rank P-1) and the ends (the embedding's backward,
    the loss at rank 0) send nothing."""
    return [(rank + flow(step), (step.kind, step.phase, i))
            for steps, batches in numbered(schedule(pp, micro_batches, rank)) for step, i in zip(steps, batches)
            if i is not None and 0 <= rank + flow(step) < pp]


def exchanges(pp: int, micro_batches: int, rank: int) -> list[tuple[list, list]]:
    """The point-to-point batch this rank issues before each schedule entry, and one after the last: (sends,
    receives), each [(pipeline rank, message)]. It sends what the previous entry gave and receives what this entry
    needs, each receive preceded by any message its sender sent earlier and not yet received (messages between two
    ranks match in order, not by name). Under NCCL a send completes only with its receive, and a rank's p2p ops run
    in issue order; posting each entry's receives with the previous entry's sends in one batch, as
    deepseek-ai/DualPipe does, leaves no two ranks each waiting on a send the other receives later."""
    incoming = {peer: deque(key for to, key in sends(pp, micro_batches, peer) if to == rank)
                for peer in (rank - 1, rank + 1) if 0 <= peer < pp}
    received, batches, given = set(), [], []
    for steps, numbers in numbered(schedule(pp, micro_batches, rank)):
        receives = []
        for step, i in zip(steps, numbers):
            source = rank - flow(step)
            while i is not None and 0 <= source < pp and (step.kind, step.phase, i) not in received:
                receives.append((source, incoming[source].popleft()))
                received.add(receives[-1][1])
        batches.append((given, receives))
        given = [(rank + flow(step), (step.kind, step.phase, i)) for step, i in zip(steps, numbers)
                 if i is not None and 0 <= rank + flow(step) < pp]
    return batches + [(given, [])]


class DeferredWeightGrads:
    """The wgrad_queue of a pipeline rank's modules that take one (wgrad_queue_holders): a deferring backward's
    weight-gradient closures (grouped_linear's, deferred_linear's) gathered as one entry, which `run_oldest` (a W step) runs; outside such a backward a
    closure runs at once."""

    def __init__(self):
        self.entries, self.open = deque(), None

    def append(self, closure):
        if self.open is None:
            closure()
        else:
            self.open.append(closure)

    @contextlib.contextmanager
    def collecting(self):
        """Inside, closures wait as one entry (a deferring backward's) instead of running."""
        self.open = []
        try:
            yield
        finally:
            self.entries.append(self.open)
            self.open = None

    def run_oldest(self):
        for closure in self.entries.popleft():
            closure()


class PairStopped(RuntimeError):
    """Raised in one side of an overlapped pair when the other side raised (Turns.errors holds that error)."""


class Turns:
    """The forward (side 0, its own thread) and the backward (side 1) of an overlapped pair take turns: one runs
    until it has launched a collective, then the turn passes (`pass_turn`) and the other runs; a side that ends
    passes it for good. The order of everything the two run is therefore fixed, the same on every rank. When a
    side raises, the other stops at its next pass (PairStopped) rather than run on alone: its next collectives
    would no longer be in the order the other ranks issue theirs, and would wait until the job is killed."""

    def __init__(self):
        self.changed, self.holder, self.done, self.errors = threading.Condition(), 0, [False, False], []

    def pass_turn(self):
        """To the other side, unless it has ended; returns when the turn is back, or raises PairStopped when the
        other side has raised."""
        with self.changed:
            me = self.holder
            if not self.done[1 - me]:
                self._hand_over(me)
            if self.errors:
                raise PairStopped(f"the other side of this overlapped pair raised {type(self.errors[0]).__name__}")

    def _hand_over(self, me: int):
        self.holder = 1 - me
        self.changed.notify_all()
        self.changed.wait_for(lambda: self.holder == me)

    def run(self, side: int, work):
        """work() as `side` once it has the turn; an error is kept (errors) for the caller to raise."""
        with self.changed:
            self.changed.wait_for(lambda: self.holder == side)
        try:
            work()
        except BaseException as error:   # kept in order: the caller raises the first, after both sides end
            self.errors.append(error)
        with self.changed:
            self.done[side] = True
            self.holder = 1 - side
            self.changed.notify_all()


class Pipeline:
    """One pipeline rank's part of a training step: its two chunks' forwards and backwards in DualPipeV order,
    activations and their gradients passed to the neighbouring ranks: before each entry of the schedule, what
    the previous entry gave and what this one needs go in one batch_isend_irecv (`exchanges`). Every rank reads
    every micro-batch's input ids (for its layers' arguments); the labels matter at rank 0, which holds the
    loss. Each chunk runs as one call of the model (its forward with hidden and layers), which mixed precision
    and FSDP hook. A W step runs the weight gradients of the oldest deferring backward (defer_wgrad), or
    nothing."""

    def __init__(self, model: MoeModel, parallel: Parallel, dtype: torch.dtype, chunks: list[range],
                 defer_wgrad: bool = False, overlap: bool = False):
        """chunks: the layers of each of the 2pp chunks (chunk_layers); the model holds at least this rank's.
        defer_wgrad: deferring backwards leave the weight gradients to W steps; under FSDP, reduced at the step's end.
        overlap: each pair's forward and backward take turns at their all-to-alls (expert parallelism)."""
        self.model, self.pp, self.rank, self.dtype = model, parallel.pp, parallel.coords["pp"], dtype
        self.group = parallel.group("pp")
        self.chunks = (self.rank, 2 * self.pp - 1 - self.rank)
        missing = sorted(set(held_layers(chunks, self.rank)) - set(model.layers))
        if len(chunks) != 2 * self.pp or missing:
            raise LayoutError(f"pipeline rank {self.rank} of pp={self.pp} runs chunks {self.chunks} of {len(chunks)}, "
                              f"but the model lacks their layers {missing}: build it with held_layers(chunks, rank)")
        self.layers = [list(chunks[chunk]) for chunk in self.chunks]
        self.deferred, self.overlap = DeferredWeightGrads() if defer_wgrad else None, overlap
        for module in wgrad_queue_holders(model) if defer_wgrad else ():
            module.wgrad_queue = self.deferred
        self.hold = defer_wgrad and bool(fsdp_modules(model))
        self.peers = {r: dist.get_global_rank(self.group, r) for r in (self.rank - 1, self.rank + 1)
                      if 0 <= r < self.pp} if self.group is not None else {}

    def step(self, batches: list[tuple], tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch (ids, labels, docs) with the loss divided by `tokens` (those
        of the whole step); returns the step's loss on rank 0 (0 elsewhere), the gradients in .grad."""
        n = len(batches)
        self.batches, self.tokens, self.loss = batches, tokens, torch.zeros((), device=tokens.device)
        self.kept, self.turn, self.outbox, self.inbox = {}, {}, [], {}
        if self.hold:
            hold_gradients(self.model)
        plan = exchanges(self.pp, n, self.rank)
        for (steps, numbers), (_, receives) in zip(numbered(schedule(self.pp, n, self.rank)), plan):
            self.exchange(receives)
            if len(steps) == 2 and self.overlap:
                self.overlapped(steps, numbers)
            else:
                for step, i in zip(steps, numbers):
                    self.run(step, i)
        self.exchange(plan[-1][1])
        if self.hold:
            reduce_held_gradients(self.model)
        return self.loss

    def run(self, step: Step, i: int):
        """One step, what it gives passed on at once."""
        if step.kind == "W":
            if self.deferred is not None:
                self.deferred.run_oldest()
                if self.hold:
                    fold_held_gradients(self.model)
            return
        out = self.forward(step, i) if step.kind == "F" else self.backward(step, i)
        if out is not None:
            self.give(step, i, out)

    def overlapped(self, steps: tuple[Step, Step], numbers: list[int]):
        """A (forward, backward) pair taking turns at their all-to-alls (Turns), the forward in a thread of its
        own. What they give goes after both have ended, the forward's first: the order `sends` has the
        neighbours expect, whichever of the two ends first."""
        (f, b), (i, j) = steps, numbers
        turns, outs, device = Turns(), {}, self.batches[i][0].device

        def forward():
            if device.type == "cuda":
                torch.cuda.set_device(device)   # the CUDA device is the thread's own
            outs[f] = self.forward(f, i)

        thread = threading.Thread(target=turns.run, args=(0, forward), name="pith-overlapped-forward")
        moe.comm_turns = turns
        try:
            thread.start()
            turns.run(1, lambda: outs.update({b: self.backward(b, j)}))
            thread.join()
        finally:
            moe.comm_turns = None
        if turns.errors:
            raise turns.errors[0]
        for step, k in ((f, i), (b, j)):
            if outs[step] is not None:
                self.give(step, k, outs[step])

    def forward(self, step: Step, i: int) -> torch.Tensor | None:
        """The chunk's forward; returns the hidden states to give on (None after the loss)."""
        ids, labels, docs = self.batches[i]
        chunk = self.chunks[step.phase]
        inp = None if chunk == 0 else self.take(step, i).requires_grad_()
        x = self.model(ids, labels, docs, hidden=inp, layers=self.layers[step.phase])
        last = chunk == 2 * self.pp - 1
        if last:
            x = x / self.tokens
            self.loss = self.loss + x.detach()
        self.kept[step.phase, i] = (inp, x)
        return None if last else x.detach()

    @torch.no_grad()
    def loss_sum(self, input_ids, labels, docs=None) -> torch.Tensor:
        """One micro-batch's forward alone, chunk after chunk along the V (for evaluation: nothing overlaps); the
        token-summed loss on rank 0, 0 elsewhere."""
        holder = [min(chunk, 2 * self.pp - 1 - chunk) for chunk in range(2 * self.pp)]
        x = loss = torch.zeros((), device=input_ids.device)
        for chunk in (c for c in range(2 * self.pp) if holder[c] == self.rank):
            if chunk == 0:
                x = None
            elif holder[chunk - 1] != self.rank:
                x = self.hidden_buffer(input_ids)
                self.transfer(dist.irecv, x, holder[chunk - 1])
            x = self.model(input_ids, labels, docs, hidden=x, layers=self.layers[self.chunks.index(chunk)])
            if chunk == 2 * self.pp - 1:
                loss = x
            elif holder[chunk + 1] != self.rank:
                self.transfer(dist.isend, x, holder[chunk + 1])
        return loss

    def transfer(self, op, tensor: torch.Tensor, rank: int):
        """One send or receive with pipeline rank `rank`, batched as the step's exchanges are: on the pipeline group's
        communicator (a plain send or recv would make a new one for the pair, at the first evaluation)."""
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, self.peers[rank], self.group)]):
            work.wait()

    def backward(self, step: Step, i: int) -> torch.Tensor | None:
        """The chunk's backward; returns the gradient of its input to give on (None for the embedding's)."""
        inp, out = self.kept.pop((step.phase, i))
        grad = None if self.chunks[step.phase] == 2 * self.pp - 1 else self.take(step, i)   # the loss: none
        with self.deferred.collecting() if self.deferred is not None and step.defer else contextlib.nullcontext():
            out.backward(grad)
        return None if inp is None else inp.grad

    def take(self, step: Step, i: int) -> torch.Tensor:
        """What the step gets from the rank before it in its flow, or at the turn of the V from this rank."""
        if 0 <= self.rank - flow(step) < self.pp:
            return self.inbox.pop((step.kind, step.phase, i))
        return self.turn.pop((step.kind, i))

    def give(self, step: Step, i: int, tensor: torch.Tensor):
        """The step's output to the next rank in its flow (sent in the batch before the next entry), or at the turn
        of the V to this rank's other phase."""
        if 0 <= self.rank + flow(step) < self.pp:
            self.outbox.append((tensor, self.peers[self.rank + flow(step)]))
        else:
            self.turn[step.kind, i] = tensor

    def hidden_buffer(self, ids: torch.Tensor) -> torch.Tensor:
        """Room for the hidden states of the micro-batch of `ids`, as a neighbour sends them."""
        return torch.empty(*ids.shape, self.model.hidden_size, dtype=self.dtype, device=ids.device)

    def exchange(self, receives: list[tuple[int, tuple]]):
        """One batch of what the previous entry gave (the outbox) and `receives` (exchanges), waited for."""
        ops = [dist.P2POp(dist.isend, tensor, peer, self.group) for tensor, peer in self.outbox]
        for source, key in receives:
            self.inbox[key] = self.hidden_buffer(self.batches[key[2]][0])
            ops.append(dist.P2POp(dist.irecv, self.inbox[key], self.peers[source], self.group))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        self.outbox = []


def main(argv=None):
    parser = argparse.ArgumentParser(description="DualPipeV's per-rank timeline and bubble for given stage costs")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=10)
    for name, default in vars(Costs()).items():
        parser.add_argument(f"--{name}", type=float, default=default, help=f"cost of {name} (default {default})")
    args = parser.parse_args(argv)
    costs = Costs(args.forward, args.backward, args.weight, args.overlapped)
    timelines, bubbles = simulate(args.pp, args.micro_batches, costs)
    span = max(line[-1][1] for line in timelines)
    print(chart(timelines))
    print(f"span {span:g}; bubble per rank {', '.join(f'{b:g}' for b in bubbles)} ({max(bubbles) / span:.1%} of the "
          f"span at most); (pp - 1)(overlapped + backward - 3 weight) = "
          f"{(args.pp - 1) * (costs.overlapped + costs.backward - 3 * costs.weight):g}")


if __name__ == "__main__":
    main()
