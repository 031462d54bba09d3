"""Host syncs of one MoE layer: its forward waits for the host at most once (ep > 1: the split sizes of the uneven
all-to-all), its backward never. On CPU the test counts the calls that would wait on CUDA; on a GPU,
torch.cuda.set_sync_debug_mode warns at each wait."""
import functools
import warnings
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_on_processes
from pith_apps.config import read_json
from pith_apps.models import gpt_oss
from pith_apps.options import MODELS, PRESETS
from pith_engine.contract import moe_layers
from pith_engine.parallel import Parallel
from pith_ops.grouped_gemm import grouped_bias_add
from pith_ops.token_permute import dedup_by_rank, ranks_of_tokens

aten = torch.ops.aten
# aten ops whose CUDA kernels read a device value on the host: an output's size (nonzero, bincount, unique,
# masked_select) or a Python value (item, equal, is_nonzero)
SYNCING = {aten.nonzero, aten._local_scalar_dense, aten.bincount, aten.masked_select, aten._unique, aten._unique2,
           aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive, aten.equal, aten.is_nonzero}


def would_sync(func, args, kwargs) -> bool:
    """Whether this aten call waits for the host on CUDA: the ops above, repeat_interleave without output_size
    (it sums the repeats) and indexing by a bool mask (a nonzero inside)."""
    packet = func.overloadpacket
    if packet is aten.repeat_interleave:
        return kwargs.get("output_size") is None
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return packet in SYNCING


class HostSyncs(TorchDispatchMode):
    """Records the calls made under it that would wait for the host on CUDA: the aten ops of would_sync, and
    Tensor.tolist (a copy to the host; on CPU it dispatches nothing, so it is patched). A copy to the CPU
    (.cpu(), .to) is not seen: on CPU there is none to see."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if would_sync(func, args, kwargs):
            self.calls.append(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        tolist = torch.Tensor.tolist
        self.patch = mock.patch.object(torch.Tensor, "tolist", lambda t: self.calls.append("tolist") or tolist(t))
        self.patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self.patch.stop()
        return super().__exit__(*exc)


def test_the_counter_sees_each_kind_of_wait_forward_and_backward():
    x, ids = torch.randn(6, requires_grad=True), torch.tensor([0, 2, 2])
    with HostSyncs() as forward:
        y = x[x > 0].sum()
        torch.bincount(ids), ids.nonzero(), ids.tolist(), ids.max().item(), torch.unique(ids)
        torch.repeat_interleave(ids, ids), torch.repeat_interleave(ids, ids, output_size=4)   # the second: no wait
    with HostSyncs() as backward:
        y.backward()   # a bool mask's index_put
    assert forward.calls == ["aten.index.Tensor", "aten.bincount.default", "aten.nonzero.default", "tolist",
                             "aten._local_scalar_dense.default", "aten._unique2.default",
                             "aten.repeat_interleave.Tensor"]
    assert backward.calls == ["aten.index_put.default"]


BATCH, SEQ = 2, 16


def moe_layer_inputs(family, parallel, device="cpu", dtype=torch.float32, capacity=None):
    """The first MoE layer of the family's tiny model (all its experts, or this ep rank's), its input (this rank's
    own tokens) and layer arguments, and an output gradient. capacity: the layer's capacity factor (0.5: about
    half its slots absent)."""
    config_cls, model_cls = MODELS[family]
    cfg = config_cls.from_dict(read_json(PRESETS / f"{family}_tiny.json") | {"initializer_range": 0.2})
    model = model_cls(cfg, parallel).to(device, dtype)
    model.init_weights(seed=3)
    generator = torch.Generator().manual_seed(parallel.rank)
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=generator).to(device, dtype).requires_grad_()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device=device)
    layer_args = model.layer_args(model.positions(ids, None), None, dtype)
    moe_layers(model)[0].balance.capacity_factor = capacity
    return moe_layers(model)[0], x, layer_args, torch.randn(x.shape, generator=generator).to(device, dtype)


def count_syncs(family, parallel, capacity=None) -> tuple[list[str], list[str]]:
    """The calls of one MoE layer's forward and of its backward that would wait for the host on CUDA, after a
    first forward and backward (where the layer looks up its process group, once)."""
    layer, x, layer_args, grad = moe_layer_inputs(family, parallel, capacity=capacity)
    layer(x, *layer_args).backward(grad)
    with HostSyncs() as forward:
        out = layer(x, *layer_args)
    with HostSyncs() as backward:
        out.backward(grad)
    return forward.calls, backward.calls


# On CUDA grouped_bias_add's backward is the segment_sum kernel (use_kernel = x.is_cuda); its CPU branch splits by
# tokens_per_expert.tolist() (2 calls per GPT-OSS layer). So the kernel runs here, under TRITON_INTERPRET (conftest),
# which a machine with a GPU does not set: there the CUDA test below counts GPT-OSS's waits.
bias_kernel = functools.partial(grouped_bias_add, use_kernel=True)
FAMILIES = ["qwen3", "deepseek_v2", "gpt_oss"]
ON_CPU = FAMILIES if not torch.cuda.is_available() else FAMILIES[:2]


@pytest.mark.parametrize("capacity", [None, 0.5])   # 0.5: slots over capacity absent, the buffers still full-size
@pytest.mark.parametrize("family", ON_CPU)
def test_one_process_moe_layer_waits_for_the_host_neither_forward_nor_backward(family, capacity):
    with mock.patch.object(gpt_oss, "grouped_bias_add", bias_kernel):
        forward, backward = count_syncs(family, Parallel(), capacity)
    assert (forward, backward) == ([], [])


def expert_parallel_body(rank, world, out):
    with mock.patch.object(gpt_oss, "grouped_bias_add", bias_kernel):
        for family in ON_CPU:
            for capacity in (None, 0.5):
                out[(family, capacity, rank)] = count_syncs(family, Parallel.build(ep=world), capacity)


def test_expert_parallel_moe_layer_waits_for_the_host_once_in_its_forward_never_in_its_backward():
    """ep 2: the forward's one wait is the .tolist() of the exchanged counts, whose sizes the all-to-all needs
    (before dedup_by_rank took the pair count from it: nonzero, bincount and tolist, 3 waits)."""
    with torch.multiprocessing.Manager() as manager:
        out = manager.dict()
        run_on_processes(2, expert_parallel_body, out)
        counts = dict(out)
    assert counts == {(family, capacity, rank): (["tolist"], []) for family in ON_CPU for capacity in (None, 0.5)
                      for rank in range(2)}


@contextmanager
def cuda_sync_warnings():
    """The warnings of set_sync_debug_mode("warn"), one per wait of the host for the GPU, in the list it yields (not
    the notice, once per process, that the mode is a prototype: on the H100 the first test's only warning)."""
    waits = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield waits
        finally:
            torch.cuda.set_sync_debug_mode("default")
            waits += [w for w in caught if "prototype" not in str(w.message)]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="set_sync_debug_mode watches CUDA (the device machine)")


@needs_cuda
@pytest.mark.parametrize("capacity", [None, 0.5])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_moe_layer_on_cuda_syncs_neither_forward_nor_backward(family, capacity):
    layer, x, layer_args, grad = moe_layer_inputs(family, Parallel(), "cuda", torch.bfloat16, capacity)
    layer(x, *layer_args).backward(grad)   # compiles the kernels and initializes the libraries first
    torch.cuda.synchronize()
    with cuda_sync_warnings() as forward:
        out = layer(x, *layer_args)
    with cuda_sync_warnings() as backward:
        out.backward(grad)
    assert (len(forward), len(backward)) == (0, 0), [str(w.message) for w in forward + backward]


@needs_cuda
def test_dedup_by_rank_on_cuda_syncs_nothing():
    """The one call of an ep > 1 forward that the one-process test above does not run: nonzero_static, the pair
    count given."""
    expert_ids = torch.tensor([[2, 3], [0, 7], [5, 4], [1, 6]], device="cuda")
    goes_to = ranks_of_tokens(expert_ids, 2, 4)
    dedup_by_rank(expert_ids, 2, goes_to, 6)   # first calls: kernels loaded
    torch.cuda.synchronize()
    with cuda_sync_warnings() as waits:
        goes_to = ranks_of_tokens(expert_ids, 2, 4)
        pair_token, _, _ = dedup_by_rank(expert_ids, 2, goes_to, 6)
    assert len(waits) == 0, [str(w.message) for w in waits]
    assert pair_token.tolist() == [1, 3, 0, 2, 1, 3]
