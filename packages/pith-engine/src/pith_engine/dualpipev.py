"""DualPipeV: which forward, backward and weight-gradient steps each pipeline rank runs, in what order, and a
simulator of the resulting timeline.

The model is cut into 2P chunks for P pipeline ranks; rank r holds chunk r (phase 0) and chunk 2P-1-r (phase
1), a V: phase 0 flows from rank 0 to P-1, turns there without communication, and phase 1 flows back, so
rank 0 holds both the input and the loss. Each rank runs, for N >= 2P micro-batches, eight runs of steps
(the DeepSeek-V3 report; deepseek-ai/DualPipe), each phase seeing every micro-batch forward and backward once
and in order. A backward may leave its weight gradients for a later W step (zero-bubble), which runs the oldest
one left. Two steps in one tuple are an overlapped pair: one micro-batch's forward interleaved with another's
backward, so that each one's communication hides behind the other's computation.

Run `python -m pith_engine.dualpipev --pp 4 --micro-batches 10` to print each rank's timeline and bubble.
"""
import argparse
from dataclasses import dataclass

from pith_engine.parallel import LayoutError


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
                          f"raise the batch size or lower --pp")
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


def _needs(pp: int, rank: int, step: Step, micro_batch: int):
    """The (rank, kind, phase, micro-batch) whose end this step waits for; None for the first forward."""
    forward = step.kind == "F"
    if step.phase == 0:   # phase 0 flows up in the forward, down in the backward
        source = rank - 1 if forward else rank + 1
        first = (rank == 0) if forward else (rank == pp - 1)
        local = None if forward else (rank, "B", 1, micro_batch)   # the turn of the V, at rank P-1
    else:
        source = rank + 1 if forward else rank - 1
        first = (rank == pp - 1) if forward else (rank == 0)
        local = (rank, "F", 0, micro_batch) if forward else (rank, "F", 1, micro_batch)   # the turn, or the loss
    return local if first else (source, step.kind, step.phase, micro_batch)


def simulate(pp: int, micro_batches: int, costs: Costs = Costs()):
    """Each rank's timeline [(start, end, steps)] and bubble (the last end minus the rank's busy time), with
    communication taken as free: a step starts once its rank is free and what it waits for has ended."""
    plans = [schedule(pp, micro_batches, rank) for rank in range(pp)]
    ended, timelines = {}, [[] for _ in range(pp)]
    seen = [dict() for _ in range(pp)]   # (kind, phase) -> micro-batches started on that rank
    progress = True
    while progress:
        progress = False
        for rank, plan in enumerate(plans):
            if len(timelines[rank]) == len(plan):
                continue
            steps = plan[len(timelines[rank])]
            work = [step for step in steps if step.kind != "W"]
            keys = [(step.kind, step.phase, seen[rank].get((step.kind, step.phase), 0)) for step in work]
            needs = [need for step, key in zip(work, keys) if (need := _needs(pp, rank, step, key[2])) is not None]
            if any(need not in ended for need in needs):
                continue
            start = max([timelines[rank][-1][1] if timelines[rank] else 0.0, *(ended[need] for need in needs)])
            end = start + costs.of(steps)
            for kind, phase, micro_batch in keys:
                ended[(rank, kind, phase, micro_batch)] = end
                seen[rank][(kind, phase)] = micro_batch + 1
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
