"""Each family's tiny model under context parallelism (cp 2 and 4 gloo processes, each holding its zigzag part of
every sequence) against the whole sequences on one process: the loss summed over the cp ranks, and each
parameter's gradient summed over them, within float32 tolerance; aux losses on (Qwen3 and GPT-OSS balancing
all data ranks' micro-batch and GPT-OSS its data rank's, DeepSeek-V2 each sequence: under cp a unit's counts
summed over its ranks). Every exchange of the ring, forward and backward, is recorded and replayed under NCCL's
rules (tests/comm_order.py)."""
import pytest
import torch
import torch.distributed as dist

from comm_order import Recorder, replay
from conftest import grad_tolerance, relative_error
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.options import MODELS, PRESETS
from pith_engine.context_parallel import zigzag_part
from pith_engine.parallel import Parallel

SEQ = 48   # GPT-OSS's tiny sliding window of 32 spans chunk borders at cp 2 (chunks of 12) and 4 (chunks of 6)
# Qwen3.5's zigzag chunks of 132 and 66 tokens each take more than one of the delta rule's 64-token chunks
SEQ_OF = {"qwen3_5": 528}


def tiny(family, parallel):
    config_cls, model_cls = MODELS[family]
    data = read_json(PRESETS / f"{family}_tiny.json") | {"initializer_range": 0.1, "router_aux_loss_coef": 0.1,
                                                         "aux_loss_alpha": 0.1}   # aux losses that show
    balance = "micro_batch" if family == "gpt_oss" else None
    model = model_cls(config_cls.from_dict(data), parallel, **({"balance": balance} if balance else {}))
    model.init_weights(seed=5)
    return model


def batch(vocab, seq):
    generator = torch.Generator().manual_seed(8)
    ids = torch.randint(0, vocab, (2, seq + 1), generator=generator)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    return ids[:, :-1], labels


def context_parallel_body(rank, world, families):
    parallel = Parallel.build(cp=world)
    for family in families:
        reference, model = tiny(family, Parallel()), tiny(family, parallel)
        ids, labels = batch(reference.config.vocab_size, SEQ_OF.get(family, SEQ))
        tokens = (labels != -100).sum()
        expected = reference.loss_sum(ids, labels) / tokens
        expected.backward()
        with Recorder() as recorder:   # ring attention's exchanges, forward and backward, replayed as NCCL runs them
            loss = model.loss_sum(zigzag_part(ids, world, rank), zigzag_part(labels, world, rank)) / tokens
            loss.backward()
        traces = recorder.gathered()
        assert sum(op.kind == "p2p" for op in traces[rank]) >= 2 * (world - 1), traces[rank]   # each layer's ring
        report = replay(traces)
        assert report is None, (family, report)
        dist.all_reduce(loss := loss.detach())
        assert relative_error(loss, expected.detach()) < 1e-6, (family, loss, expected)
        wanted = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            dist.all_reduce(param.grad)
            assert relative_error(param.grad, wanted[name].grad) < grad_tolerance(family, name), (family, world, name)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_family_under_context_parallelism_gives_the_whole_sequences_loss_and_gradients(cp):
    run_on_processes(cp, context_parallel_body, list(MODELS))
