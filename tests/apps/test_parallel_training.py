"""Expert and data parallelism (FSDP2) on spawned gloo processes against the single-process reference on the
same global batch: loss, every parameter's gradient, the clipped global norm and the aux-free expert bias; and
with --fp8's weight cache, whose weights FSDP2 gathers anew for each forward and backward."""
import pytest
import torch
import torch.distributed as dist

from conftest import grad_tolerance, relative_error
from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.models.layers import use_fp8
from pith_apps.options import MODELS, PRESETS
from pith_apps.train import build_model
from pith_engine.data_parallel import clip_grad_norm
from pith_engine.moe import update_expert_bias
from pith_engine.parallel import Parallel
from pith_ops.fp8 import Fp8WeightCache

BATCH, SEQ = 4, 16


def build(family, parallel, balance):
    """The app's build: on the meta device, sharded, then each rank draws only its part of the weights."""
    config_cls, model_cls = MODELS[family]
    cfg = config_cls.from_dict(read_json(PRESETS / f"{family}_tiny.json") | {"initializer_range": 0.2})
    return build_model(model_cls, cfg, parallel, torch.device("cpu"), torch.float32, seed=3, seq_len=SEQ, balance=balance)


def global_batch(vocab, seq=SEQ):
    ids = torch.randint(0, vocab, (BATCH, seq + 1), generator=torch.Generator().manual_seed(5))
    return ids[:, :-1], ids[:, 1:]


def train_step(model, ids, labels, tokens):
    """One step's gradients, clipped to a norm of 0.5; returns (loss share, norm before the clip)."""
    loss = model.loss_sum(ids, labels) / tokens
    loss.backward()
    norm = clip_grad_norm(model.parameters(), 0.5)
    update_expert_bias(model)
    return loss.detach(), norm


def full_state(model):
    """{name: (first expert or 0, gradient, expert bias or parameter)} as full tensors, this rank's experts."""
    result = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        first = model.get_submodule(name.rsplit(".", 1)[0]).first_expert if ".mlp.experts." in name else 0
        result[name] = (first, grad)
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            result[name] = (0, buffer.clone())
    return result


def with_fp8(model, keep: bool) -> Fp8WeightCache:
    """--fp8's weight cache set on the model, as the app makes it: kept on one process, not where FSDP2 shards."""
    cache = Fp8WeightCache(keep=keep)
    use_fp8(model, cache, dense=True)
    return cache


def parallel_body(rank, world, layouts, out):
    """Every layout of this world size in one spawn: each process pays its imports once. fp8: with --fp8's cache
    on a longer batch (FP8_SEQ)."""
    for family, dp, ep, balance, fp8 in layouts:
        parallel = Parallel.build(dp=dp, ep=ep)
        model = build(family, parallel, balance)
        cache = with_fp8(model, keep=False) if fp8 else None
        ids, labels = global_batch(model.config.vocab_size, FP8_SEQ if fp8 else SEQ)
        share = BATCH // parallel.data_ranks
        rows = slice(parallel.data_rank * share, (parallel.data_rank + 1) * share)
        loss, norm = train_step(model, ids[rows], labels[rows], labels.numel())
        dist.all_reduce(loss)
        torch.save(dict(loss=loss, norm=norm, state=full_state(model), quantized=cache and cache.quantized,
                        held=cache and len(cache.copies)), out / f"{family}-{dp}-{ep}-{balance}-{fp8}-{rank}.pt")


LAYOUTS = [("qwen3", 1, 2, None), ("qwen3", 2, 1, None), ("qwen3", 1, 4, None), ("qwen3", 2, 2, "aux_free"),
           ("deepseek_v2", 1, 2, None), ("deepseek_v2", 2, 1, None), ("deepseek_v2", 2, 2, None),
           ("deepseek_v2", 1, 4, "global_batch"), ("gpt_oss", 1, 2, None), ("gpt_oss", 2, 2, None),
           ("qwen3_5", 1, 2, None), ("qwen3_5", 2, 1, None)]
# with --fp8's cache: 128 tokens per rank, so that the 1 x 128 blocks along the tokens that the dense weight
# gradients quantize are the one process's blocks too
FP8_LAYOUTS, FP8_SEQ = [("qwen3", 2, 1, None), ("deepseek_v2", 1, 2, None), ("gpt_oss", 2, 1, None)], 64


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    for world in (2, 4):
        layouts = [(*layout, False) for layout in LAYOUTS] + [(*layout, True) for layout in FP8_LAYOUTS]
        run_on_processes(world, parallel_body, [layout for layout in layouts if layout[1] * layout[2] == world], out)
    return out


def reference_and_results(family, dp, ep, balance, results, fp8=False):
    """The one-process step (fp8: with the kept cache, as the app's) and each rank's results of this layout."""
    model = build(family, Parallel(), balance)
    cache = with_fp8(model, keep=True) if fp8 else None
    ids, labels = global_batch(model.config.vocab_size, FP8_SEQ if fp8 else SEQ)
    loss, norm = train_step(model, ids, labels, labels.numel())
    ranks = [torch.load(results / f"{family}-{dp}-{ep}-{balance}-{fp8}-{rank}.pt") for rank in range(dp * ep)]
    return (loss, norm, full_state(model), cache), ranks


def assert_the_one_process_step(family, reference, ranks):
    """float32: loss within 1e-6, every gradient within 1e-5 relative error (only summation order differs; Qwen3.5's
    within grad_tolerance's)."""
    loss, norm, state = reference[:3]
    for rank, result in enumerate(ranks):
        assert abs(result["loss"].item() - loss.item()) < 1e-6 * loss.item()
        assert abs(result["norm"].item() - norm.item()) < 1e-5 * norm.item() and norm.item() > 0.5   # clip active
        for name, (first, value) in result["state"].items():
            expected = state[name][1]
            expected = expected[first:first + value.shape[0]] if ".mlp.experts." in name else expected
            assert relative_error(value, expected) < grad_tolerance(family, name), (rank, name)
        assert len(result["state"]) == len(state)


@pytest.mark.parametrize("family,dp,ep,balance", LAYOUTS)
def test_expert_and_data_parallel_step_equals_one_process(family, dp, ep, balance, results):
    assert_the_one_process_step(family, *reference_and_results(family, dp, ep, balance, results))


@pytest.mark.parametrize("family,dp,ep,balance", FP8_LAYOUTS)
def test_the_fp8_step_on_sharded_weights_equals_one_process(family, dp, ep, balance, results):
    """--fp8 (emulated; float32 around it) on weights FSDP2 gathers: each rank quantizes the same blocks as one
    process, so the step is the one-process step within the float32 tolerances. The one process quantizes each FP8
    weight once and holds it to the step; each rank quantizes it at each use, forward and backward (twice), and
    holds none."""
    reference, ranks = reference_and_results(family, dp, ep, balance, results, fp8=True)
    assert_the_one_process_step(family, reference, ranks)
    cache = reference[3]
    assert cache.quantized == len(cache.copies) > 0
    assert all(result["quantized"] == 2 * cache.quantized and result["held"] == 0 for result in ranks)
