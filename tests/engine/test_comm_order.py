"""The NCCL-order checker (tests/comm_order.py) on planted traces: it reports a cycle of waits, a collective that
differs between ranks (a broadcast that left other contents), one a rank never issues and a send no one receives, and
passes the same messages in an order NCCL completes; and on gloo, where it reports what gloo runs and NCCL would not:
two same-size messages that arrive swapped, a transposed receive of the same element count, and two groups that two
ranks use in opposite orders."""
import pytest
import torch
import torch.distributed as dist

from comm_order import Op, Recorder, fingerprint, replay
from distributed import run_on_processes


def traces(**ranks):
    """{rank: [Op]} from ("send"|"recv", peer) p2p ops (a list of them: one batch) and ("all_reduce"|"broadcast", n[,
    group[, content]]) collectives over ranks 0 and 1; an op (key "wait") waited for before the next is issued."""
    out = {}
    for name, steps in ranks.items():
        rank, ops = int(name[1:]), []
        for step in steps:
            waited = isinstance(step, dict)
            step = step["wait"] if waited else step
            if step[0] in ("all_reduce", "all_to_all_single", "broadcast"):
                op = Op(rank, len(ops), step[2] if len(step) > 2 else "dp", step[0], sizes=(step[1], "float32"),
                        members=(0, 1), content=step[3] if len(step) > 3 else None)
            else:
                batch = step if isinstance(step, list) else [step]
                op = Op(rank, len(ops), "pp", "p2p", parts=[(kind, peer, 8, "float32") for kind, peer in batch])
            op.waits = [ops[-1].index] if ops and ops[-1].waited else []
            op.waited = waited
            ops.append(op)
        out[rank] = ops
    return out


def test_the_pipelines_old_order_is_a_cycle_and_batched_exchanges_complete():
    """Each rank sends two messages before it receives the other's (the pipeline's first steps before the fix): both
    sends wait for receives that are queued behind them. The same messages with each step's receive posted with
    the previous step's send, in one batch, complete."""
    report = replay(traces(r0=[("send", 1), ("send", 1), ("recv", 1)], r1=[("recv", 0), ("send", 0), ("recv", 0)]))
    assert report.startswith("NCCL would hang, in this cycle of waits:"), report
    assert "rank 0 op 1 (group pp): send to 1" in report and "rank 1 op 1 (group pp): send to 0" in report, report
    assert replay(traces(r0=[("send", 1), [("send", 1), ("recv", 1)]],
                         r1=[("recv", 0), [("send", 0), ("recv", 0)]])) is None


def test_a_wait_orders_ops_of_other_groups_and_two_groups_run_in_one_order():
    """rank 0 waits for its send before its all-reduce, rank 1 for its all-reduce before its receive: a cycle through
    two communicators; without the waits (both in flight) no cycle of waits, but the two groups of both ranks in
    opposite orders, which NCCL can deadlock on; in one order on both ranks it completes."""
    report = replay(traces(r0=[{"wait": ("send", 1)}, ("all_reduce", 4)], r1=[{"wait": ("all_reduce", 4)}, ("recv", 0)]))
    assert "was issued after a wait for" in report and report.count("\n  rank") == 5, report
    report = replay(traces(r0=[("send", 1), ("all_reduce", 4)], r1=[("all_reduce", 4), ("recv", 0)]))
    assert report == (
        "ranks 0 and 1 issue the ops of two groups they are both in in opposite orders, which NCCL can deadlock on "
        "(each GPU may run its first kernel alone, which waits for the other's):\n"
        "  rank 0 op 0 (group pp): send to 1 (8, float32)\n"
        "    before rank 0 op 1 (group dp): all_reduce (4, 'float32')\n"
        "  but rank 1 op 0 (group dp): all_reduce (4, 'float32')\n"
        "    before rank 1 op 1 (group pp): recv from 0 (8, float32)"), report
    assert replay(traces(r0=[("send", 1), ("all_reduce", 4)], r1=[("recv", 0), ("all_reduce", 4)])) is None


def test_collectives_that_differ_between_ranks_and_a_lone_send_are_reported():
    """Two all-reduces of other sizes in swapped order, broadcasts that left other contents, a collective rank 0 never
    issues (named as rank 1's #1) and a send no one receives: each reported as such."""
    report = replay(traces(r0=[("all_reduce", 4), ("all_reduce", 8)], r1=[("all_reduce", 8), ("all_reduce", 4)]))
    assert report.startswith("collective #0 of group dp differs between ranks:") and "(4, 'float32')" in report
    report = replay(traces(r0=[("broadcast", 4, "dp", "aa")], r1=[("broadcast", 4, "dp", "ab")]))
    assert report.startswith("collective #0 of group dp differs") and report.endswith("left other contents"), report
    report = replay(traces(r0=[("all_reduce", 4)], r1=[("all_reduce", 4), ("all_reduce", 4)]))
    assert report.startswith("rank 0 never issues collective #1 of group dp (ranks [0, 1]), which NCCL would wait for "
                             "forever:\n  rank 1 op 1 (group dp): all_reduce (4, 'float32')"), report
    report = replay(traces(r0=[("send", 1), ("send", 1)], r1=[("recv", 0)]))
    assert "its send (#1 from rank 0 to rank 1) has no partner" in report, report


def recorded_body(rank, world):
    """The recorder on gloo: an uneven all_to_all_single, a batched exchange and an all-reduce, recorded with their
    waits, shapes and the fingerprints of what was sent and received; two ranks issuing all-to-alls of other sizes in
    swapped order are reported."""
    with Recorder() as recorder:
        x = torch.arange(3.0 + rank).view(-1, 1).repeat(1, 2)
        splits = [[1, 2], [2, 2]]   # rank 0 sends 1 row to itself, 2 to rank 1; rank 1 sends 2 and 2
        out = torch.empty(splits[0][rank] + splits[1][rank], 2)
        dist.all_to_all_single(out, x, [s[rank] for s in splits], splits[rank], async_op=True).wait()
        mine, other = torch.full((4,), float(rank)), torch.empty(4)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank),
                                            dist.P2POp(dist.irecv, other, 1 - rank)]):
            work.wait()
        dist.all_reduce(other)
    ops = recorder.gathered()
    assert [op.kind for op in ops[rank]] == ["all_to_all_single", "p2p", "all_reduce"]
    assert ops[rank][0].sizes == (((2,), "torch.float32"), tuple(s[rank] for s in splits), tuple(splits[rank]))
    assert ops[rank][1].parts == [("send", 1 - rank, (4,), "torch.float32", fingerprint(mine)),
                                  ("recv", 1 - rank, (4,), "torch.float32", fingerprint(torch.full((4,), 1.0 - rank)))]
    assert ops[rank][1].waits == [0] and ops[rank][2].waits == [1, 1], ops[rank]
    assert ops[rank][1].site.startswith("test_comm_order.py:"), ops[rank][1].site
    assert replay(ops) is None
    ops[1][0].sizes = (ops[1][0].sizes[0], (3, 2), (2, 2))   # rank 1 would take 3 rows from rank 0, which sends 2
    report = replay(ops)
    assert "recorded_body sends 2 rows to rank 1\n  but rank 1 op 0" in report and "takes 3 from rank 0" in report


def mismatches_body(rank, world):
    """What gloo completes and NCCL would not, each reported naming both ops: two same-size messages whose tags make
    gloo deliver them swapped (NCCL matches the k-th send with the k-th receive: the fingerprints differ); a [2, 3]
    tensor received into a [3, 2] one; all-reduces on two groups of both ranks, issued in opposite orders."""
    first, second = torch.zeros(4), torch.ones(4)
    with Recorder() as recorder:   # rank 0 sends tags 1, 2; rank 1 receives tag 2 first
        for work in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, first, 1, tag=1), dist.P2POp(dist.isend, second, 1, tag=2)] if rank == 0 else
                [dist.P2POp(dist.irecv, torch.empty(4), 0, tag=2), dist.P2POp(dist.irecv, torch.empty(4), 0, tag=1)]):
            work.wait()
    report = replay(recorder.gathered())
    assert report.startswith(f"send #0 from rank 0 to rank 1 (group 0) does not match its receive: fingerprint "
                             f"{fingerprint(first)} sent, {fingerprint(second)} received\n  rank 0 op 0"), report
    assert "\n  rank 1 op 0 (group 0): recv from 0 ((4,), torch.float32" in report, report
    with Recorder() as recorder:
        if rank == 0:
            dist.send(torch.arange(6.0).view(2, 3), 1)
        else:
            dist.recv(torch.empty(3, 2), 0)
    report = replay(recorder.gathered())
    assert "does not match its receive: shape (2, 3) sent, (3, 2) received\n  rank 0 op 0 (group 0): send to 1 " \
           "((2, 3), torch.float32, #" in report and "mismatches_body\n  rank 1 op 0" in report, report
    groups = [dist.new_group([0, 1]) for _ in range(2)]
    with Recorder() as recorder:
        works = [dist.all_reduce(torch.ones(2), group=groups[g], async_op=True) for g in ((0, 1), (1, 0))[rank]]
        for work in works:
            work.wait()
    names = [g.group_name for g in groups]
    report = replay(recorder.gathered())
    assert report.startswith("ranks 0 and 1 issue the ops of two groups they are both in in opposite orders, which "
                             f"NCCL can deadlock on") and f"rank 0 op 0 (group {names[0]})" in report and \
        f"before rank 0 op 1 (group {names[1]})" in report and f"but rank 1 op 0 (group {names[1]})" in report, report


def recorded_bodies(rank, world):
    recorded_body(rank, world)
    mismatches_body(rank, world)


def test_the_recorder_keeps_what_gloo_runs_and_reports_what_nccl_would_not():
    run_on_processes(2, recorded_bodies)
