"""Each family's tiny model under context parallelism (cp 2 and 4 gloo processes, each holding its zigzag part of
every sequence) against the whole sequences on one process: the loss summed over the cp ranks, and each
parameter's gradient summed over them, within float32 tolerance; aux losses on (Qwen3 and GPT-OSS balancing
all data ranks' micro-batch and GPT-OSS its data rank's, DeepSeek-V2 each sequence: under cp a unit's counts
summed over its ranks). Every exchange of the ring, forward and backward, is recorded and replayed under NCCL's
rules (tests/comm_order.py). DeepSeek-V2's ring, which expands its latent again in the backward, under FSDP2 and
on compute copies of fp32 masters (ComputeCasts)."""
import pytest
import torch
import torch.distributed as dist

from comm_order import Recorder, replay
from conftest import grad_tolerance, relative_error
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.models.deepseek_v2 import rotary_tables
from pith_apps.options import MODELS, PRESETS
from pith_engine.context_parallel import zigzag_part, zigzag_positions
from pith_engine.data_parallel import ComputeCasts, shard_model
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


def deepseek_under_fsdp(rank, world, parallel):
    """The model under FSDP2 (kv_b_proj's weight gathered again for the backward, the gradients reduce-scattered
    after it), float32: every gradient, summed over the cp ranks by FSDP2, within 1e-5 of one process's."""
    reference, model = tiny("deepseek_v2", Parallel()), shard_model(tiny("deepseek_v2", parallel), parallel)
    ids, labels = batch(reference.config.vocab_size, SEQ)
    tokens = (labels != -100).sum()
    (reference.loss_sum(ids, labels) / tokens).backward()
    (model.loss_sum(zigzag_part(ids, world, rank), zigzag_part(labels, world, rank)) / tokens).backward()
    wanted = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert relative_error(param.grad.full_tensor(), wanted[name].grad) < 1e-5, ("fsdp", name)


def deepseek_attention_on_compute_copies(rank, world, parallel):
    """An attention on fp32 masters computing in float64 copies (ComputeCasts, which puts the masters back after each
    forward: the path of its bf16 copies, in a dtype whose rounding leaves the comparison tight): the input's
    gradient and every master's, summed over the cp ranks, within 1e-5 of one process's."""
    models = [tiny("deepseek_v2", p) for p in (Parallel(), parallel)]
    reference, attention = (model.get_submodule("model.layers.1.self_attn") for model in models)
    generator = torch.Generator().manual_seed(6)
    x, weight = (torch.randn(2, SEQ, reference.o_proj.out_features, generator=generator, dtype=torch.float64)
                 for _ in range(2))
    mine, config = zigzag_positions(SEQ // world, world, rank), models[0].config
    grads = []
    for module, positions in ((reference, torch.arange(SEQ)), (attention, mine)):
        ComputeCasts(torch.float64).register(module)
        leaf, tables = x[:, positions].clone().requires_grad_(), rotary_tables(config, positions, torch.float64)
        (module(leaf, *tables) * weight[:, positions]).sum().backward()
        grads.append(leaf.grad)
    assert relative_error(grads[1], grads[0][:, mine]) < 1e-5
    wanted = dict(reference.named_parameters())
    for name, param in attention.named_parameters():
        dist.all_reduce(param.grad)
        assert param.grad.dtype == torch.float32 and relative_error(param.grad, wanted[name].grad) < 1e-5, name


def deepseek_wrapped_body(rank, world):
    parallel = Parallel.build(cp=world)
    deepseek_under_fsdp(rank, world, parallel)
    deepseek_attention_on_compute_copies(rank, world, parallel)


def test_deepseeks_expanding_weight_gets_its_gradient_under_fsdp_and_compute_copies():
    """cp 2: DeepSeek-V2's ring expands the latent again in its backward, with the forward's kv_b_proj weight
    (deepseek_under_fsdp, deepseek_attention_on_compute_copies)."""
    run_on_processes(2, deepseek_wrapped_body)
