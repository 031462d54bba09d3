"""DualPipeV's schedule and its simulator (pith_engine.dualpipev) against the schedule's stated facts."""
import threading

import pytest

from comm_order import Op, replay
from pith_engine.dualpipev import Costs, Turns, exchanges, main, schedule, simulate
from pith_engine.parallel import LayoutError

LAYOUTS = [(pp, micro_batches) for pp in (1, 2, 3, 4, 8) for micro_batches in (2 * pp, 2 * pp + 3, 4 * pp)]


@pytest.mark.parametrize("pp, micro_batches", LAYOUTS)
def test_each_rank_runs_every_micro_batch_forward_and_backward_once_per_phase(pp, micro_batches):
    """N forwards and N backwards per phase on every rank; an overlapped pair is one forward and one backward;
    every W step has a deferred backward left to run, and none is left at the end."""
    for rank in range(pp):
        steps = schedule(pp, micro_batches, rank)
        flat = [step for group in steps for step in group]
        for kind in "FB":
            for phase in (0, 1):
                assert sum(s.kind == kind and s.phase == phase for s in flat) == micro_batches, (rank, kind, phase)
        assert all(len(group) == 1 or [s.kind for s in group] == ["F", "B"] for group in steps)
        waiting = 0
        for step in flat:
            waiting += step.kind == "B" and step.defer
            waiting -= step.kind == "W"
            assert waiting >= 0, rank
        assert waiting == 0 and flat[0].kind == "F" and flat[-1].kind == "W"


@pytest.mark.parametrize("pp, micro_batches", LAYOUTS)
@pytest.mark.parametrize("costs", [Costs(1, 2, 1, 2.5), Costs(1, 2, 0.5, 2.8), Costs(2, 3, 1, 4), Costs(1, 2, 1, 3)])
def test_the_simulated_bubble_with_equal_chunk_costs_is_the_stated_one(pp, micro_batches, costs):
    """(pp - 1)(F&B + B - 3W), the DeepSeek-V3 report's DualPipeV bubble, at the last rank (within 1e-9); the
    other ranks idle less; no rank waits forever (the simulation ends)."""
    timelines, bubbles = simulate(pp, micro_batches, costs)
    assert max(bubbles) == pytest.approx((pp - 1) * (costs.overlapped + costs.backward - 3 * costs.weight), abs=1e-9)
    assert max(bubbles) == pytest.approx(bubbles[-1], abs=1e-9)
    for line in timelines:
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(line, line[1:]))   # one step at a time per rank


@pytest.mark.parametrize("pp", range(2, 17))
def test_the_planned_exchanges_complete_under_nccls_rules_and_match_every_message(pp):
    """Each rank's p2p batches (exchanges), each waited for before the next, as NCCL would run them: every send meets
    a receive of the same message (k-th to k-th between two ranks), and no cycle of waits, at 2pp, 2pp + 1, 3pp and
    4pp micro-batches. The runtime issues these batches (test_nccl_order.py records it at pp 2, 4 and 8)."""
    for micro_batches in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp):
        plans = {rank: exchanges(pp, micro_batches, rank) for rank in range(pp)}
        for a, b in ((a, a + 1) for a in range(pp - 1)):
            for x, y in ((a, b), (b, a)):
                sent = [key for given, _ in plans[x] for to, key in given if to == y]
                taken = [key for _, receives in plans[y] for of, key in receives if of == x]
                assert sent == taken and len(sent) == 2 * micro_batches, (pp, micro_batches, x, y)
        traces = {rank: [] for rank in range(pp)}
        for rank, plan in plans.items():
            for given, receives in (batch for batch in plan if batch[0] or batch[1]):
                parts = [("send", to, 1, "x") for to, _ in given] + [("recv", of, 1, "x") for of, _ in receives]
                ops = traces[rank]
                ops.append(Op(rank, len(ops), "pp", "p2p", parts=parts, waits=[len(ops) - 1] if ops else []))
        assert replay(traces) is None, (pp, micro_batches)


def test_too_few_micro_batches_is_one_line_naming_the_minimum():
    with pytest.raises(LayoutError, match=r"^DualPipeV needs at least 2 x pp = 8 micro-batches per step, not 7; "
                                          r"raise --batch-size, lower --micro-batch-size \(micro-batches: the batch "
                                          r"size over micro-batch size x data ranks\) or lower --pp$"):
        schedule(4, 7, 0)


def test_the_planning_command_prints_each_ranks_timeline_and_the_bubble(capsys):
    main(["--pp", "2", "--micro-batches", "4", "--forward", "1", "--backward", "2", "--weight", "1",
          "--overlapped", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["rank 0", "rank 1"]
    assert lines[2].endswith("(pp - 1)(overlapped + backward - 3 weight) = 2") and "bubble per rank" in lines[2]
    assert set(lines[1].split(": ")[1]) <= set("FfBbWX.")


def run_sides(*sides):
    """Side 0 in a thread and side 1 here, as a pipeline's overlapped pair; sides: (name, passes, error to raise
    after them). Returns (what each side ran, in order, each pass after its work; the errors kept)."""
    turns, order = Turns(), []

    def side(name, passes, error=None):
        def work():
            for n in range(passes):
                order.append(f"{name}{n}")
                turns.pass_turn()
            if error:
                raise error
        return work

    thread = threading.Thread(target=turns.run, args=(0, side(*sides[0])))
    thread.start()
    turns.run(1, side(*sides[1]))
    thread.join()
    return order, turns.errors


def test_turns_alternate_at_each_pass_until_one_side_ends():
    """Each side runs until it passes the turn; once one has ended the other runs on alone."""
    assert run_sides(("f", 4), ("b", 2)) == (["f0", "b0", "f1", "b1", "f2", "f3"], [])
    assert run_sides(("f", 1), ("b", 3)) == (["f0", "b0", "b1", "b2"], [])


@pytest.mark.parametrize("failing", [0, 1])
def test_when_one_side_raises_the_other_stops_at_its_next_pass_and_the_first_error_is_kept(failing):
    """A side that raised (after 2 passes) stops its partner at the partner's next pass, where the partner would
    have waited for a collective the other ranks no longer issue in that order: nothing more runs on either side."""
    sides = [("f", 4), ("b", 4)]
    sides[failing] = (sides[failing][0], 2, ValueError("bad"))
    order, errors = run_sides(*sides)
    assert order == ["f0", "b0", "f1", "b1", "f2"][:5 if failing else 4], order
    assert [str(error) for error in errors] == ["bad", "the other side of this overlapped pair raised ValueError"]
