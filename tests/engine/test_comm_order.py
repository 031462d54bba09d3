"""The NCCL-order checker (tests/comm_order.py) on planted traces: it reports a cycle of waits, a collective that
differs between ranks and a send no one receives, and passes the same messages in an order NCCL completes."""
import pytest
import torch
import torch.distributed as dist

from comm_order import Op, Recorder, replay
from distributed import run_on_processes


def traces(**ranks):
    """{rank: [Op]} from ("send"|"recv", peer) p2p ops (a list of them: one batch) and ("all_reduce", n)
    collectives over ranks 0 and 1; an op (key "wait") waited for before the next is issued."""
    out = {}
    for name, steps in ranks.items():
        rank, ops = int(name[1:]), []
        for step in steps:
            waited = isinstance(step, dict)
            step = step["wait"] if waited else step
            if step[0] in ("all_reduce", "all_to_all_single"):
                op = Op(rank, len(ops), step[2] if len(step) > 2 else "dp", step[0], sizes=(step[1], "float32"),
                        members=(0, 1))
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


def test_a_wait_orders_ops_of_other_groups():
    """rank 0 waits for its send before its all-reduce, rank 1 for its all-reduce before its receive: a cycle through
    two communicators; without the waits (both in flight) it completes."""
    report = replay(traces(r0=[{"wait": ("send", 1)}, ("all_reduce", 4)], r1=[{"wait": ("all_reduce", 4)}, ("recv", 0)]))
    assert "was issued after a wait for" in report and report.count("\n  rank") == 5, report
    assert replay(traces(r0=[("send", 1), ("all_reduce", 4)], r1=[("all_reduce", 4), ("recv", 0)])) is None


def test_collectives_that_differ_between_ranks_and_a_lone_send_are_reported():
    report = replay(traces(r0=[("all_reduce", 4), ("all_reduce", 8)], r1=[("all_reduce", 8), ("all_reduce", 4)]))
    assert report.startswith("collective #0 of group dp differs between ranks:") and "(4, 'float32')" in report
    report = replay(traces(r0=[("all_reduce", 4)], r1=[("all_reduce", 4), ("all_reduce", 4)]))
    assert "runs {0: 1, 1: 2} collectives per rank: rank 0 never reaches rank 1 op 1" in report, report
    report = replay(traces(r0=[("send", 1), ("send", 1)], r1=[("recv", 0)]))
    assert "its send (#1 from rank 0 to rank 1) has no partner" in report, report


def recorded_body(rank, world):
    """The recorder on gloo: an uneven all_to_all_single, a batched exchange and an all-reduce, recorded with their
    waits and sizes; two ranks issuing all-to-alls of other sizes in swapped order are reported."""
    with Recorder() as recorder:
        x = torch.arange(3.0 + rank).view(-1, 1).repeat(1, 2)
        splits = [[1, 2], [2, 2]]   # rank 0 sends 1 row to itself, 2 to rank 1; rank 1 sends 2 and 2
        out = torch.empty(splits[0][rank] + splits[1][rank], 2)
        dist.all_to_all_single(out, x, [s[rank] for s in splits], splits[rank], async_op=True).wait()
        other = torch.empty(4)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), 1 - rank),
                                            dist.P2POp(dist.irecv, other, 1 - rank)]):
            work.wait()
        dist.all_reduce(other)
    ops = recorder.gathered()
    assert [op.kind for op in ops[rank]] == ["all_to_all_single", "p2p", "all_reduce"]
    assert ops[rank][0].sizes == ((2, "torch.float32"), tuple(s[rank] for s in splits), tuple(splits[rank]))
    assert ops[rank][1].waits == [0] and ops[rank][2].waits == [1, 1], ops[rank]
    assert ops[rank][1].site.startswith("test_comm_order.py:"), ops[rank][1].site
    assert replay(ops) is None
    ops[1][0].sizes = (ops[1][0].sizes[0], (3, 2), (2, 2))   # rank 1 would take 3 rows from rank 0, which sends 2
    report = replay(ops)
    assert "recorded_body sends 2 rows to rank 1\n  but rank 1 op 0" in report and "takes 3 from rank 0" in report


def test_the_recorder_keeps_what_gloo_runs():
    run_on_processes(2, recorded_body)
