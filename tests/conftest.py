"""Shared test setup. Triton kernels run on CPU only through Triton's interpreter, which must be switched
on before the first kernel is defined, so it is set here, before any test module imports pith_ops."""
import gc
import os
import tempfile
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the app's default --data-cache (and Hugging Face's caches) in a folder of this test session, not the user's
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pith-tests-cache-")

# Where Triton kernels run in tests: the GPU when there is one, else the CPU under the interpreter.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm of the difference over the norm of the expected value, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def grad_tolerance(family: str, name: str) -> float:
    """The float32 relative tolerance of parameter `name`'s gradient under a layout (or compiled) against one eager
    process: 1e-5, summation order alone. Qwen3.5's delta rule solves a triangular system per chunk, which amplifies
    that rounding: 3e-5 for its parameters (1.1e-5 seen under dp 2 and cp 4), 3e-4 for those of its decay,
    A_log, dt_bias and in_proj_a, each gradient a sum over every token of terms of both signs (3.4e-5 seen under cp
    2, 1.4e-4 compiled; in_proj_a 3.7e-5 under cp 4 over 528 tokens, the sequential hand-over of the state and the
    affine scan alike)."""
    if family != "qwen3_5":
        return 1e-5
    return 3e-4 if name.endswith(("A_log", "dt_bias", "in_proj_a.weight")) else 3e-5


def recording_fp8_cache(steps: list) -> type:
    """An Fp8WeightCache class that appends (weights quantized so far, bytes of FP8 blocks held) to `steps` as each
    optimizer step begins: set as pith_apps.train.Fp8WeightCache, it records what the app's cache did."""
    from pith_ops.fp8 import Fp8WeightCache   # here: pith_ops only after TRITON_INTERPRET is set above

    class RecordingCache(Fp8WeightCache):
        def new_step(self):
            held = sum(t.nbytes for _, made in self.copies.values() for layout in made for t in layout)
            steps.append((self.quantized, held))
            super().new_step()
    return RecordingCache


class SavedBytes:
    """Bytes of the distinct storages one forward keeps for its backward, `leave_out` tensors (parameters, shared ones)
    left out: what autograd packs (saved_tensors_hooks; checkpoint's regions' inputs among them) and is still alive
    after the forward, its output held (a region that keeps nothing lets its inputs go), and the outputs selective
    checkpointing caches (each output of an op that returns several, as SDPA does). Use: made before the model's
    recompute_stages (it patches pith_engine.recompute through `monkeypatch`), counting around the forward."""

    def __init__(self, monkeypatch):
        import pith_engine.recompute as recompute   # here: pith_ops only after TRITON_INTERPRET is set above
        self.caches = []
        sac = recompute.create_selective_checkpoint_contexts

        def caching(*args, **kwargs):
            forward, recomputing = sac(*args, **kwargs)
            self.caches.append(forward.storage)   # SAC's cache of the outputs it keeps
            return forward, recomputing
        monkeypatch.setattr(recompute, "create_selective_checkpoint_contexts", caching)

    def of(self, forward, leave_out) -> int:
        packed = []

        def pack(tensor):
            packed.append(weakref.ref(tensor))
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = forward()   # held while counting: its autograd graph holds what the backward will read
        gc.collect()
        # one op's outputs in SAC's cache, each in its wrapper (.val)
        cached = [wrapper.val for storage in self.caches for outputs in storage.values() for entry in outputs.values()
                  for wrapper in torch.utils._pytree.tree_leaves(entry) if hasattr(wrapper, "val")]
        kept = [ref() for ref in packed] + cached
        left_out = {t.untyped_storage().data_ptr() for t in leave_out}
        sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept
                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in left_out}
        del output
        return sum(sizes.values())


# The quick tier (`hatch test -- -m quick`): one representative test of every package, of each parallel layout
# against its reference and of the app's loop, for a change's first check; the full suite stays the judge.
QUICK = ("ops/test_swiglu.py::test_swiglu_kernel_matches_reference_forward_and_backward",
         "ops/test_token_permute_and_grouped_gemm.py::test_grouped_linear_matches_per_expert_matmul_forward_and_backward",
         "ops/test_cross_entropy.py::test_matches_reference_loss_and_gradients",
         "ops/test_fp8.py::test_the_fp8_linear_is_the_gemms_of_its_dequantized_operands",
         "ops/test_gated_delta.py::test_the_chunked_rule_is_transformers_torch_path",
         "engine/test_moe.py::test_five_stages_in_order_equal_the_direct_computation",
         "engine/test_dualpipev.py::test_the_planned_exchanges_complete_under_nccls_rules_and_match_every_message",
         "engine/test_comm_order.py::test_the_pipelines_old_order_is_a_cycle_and_batched_exchanges_complete",
         "engine/test_expert_parallel.py::test_expert_parallel_dispatch_and_combine_equal_one_process",
         "engine/test_context_parallel.py::test_ring_attention_over_the_zigzag_layout_is_the_whole_sequences_attention",
         "engine/test_recompute.py::test_each_mode_gives_the_gradients_of_no_recompute",
         "engine/test_optim_checkpoint.py::test_crash_during_save_keeps_the_previous_checkpoint",
         "engine/test_muon.py::test_two_steps_equal_the_formulas_and_the_rest_steps_as_adamw",
         "apps/test_hf_checkpoint.py::test_qwen3_matches_transformers",
         "apps/test_train.py::test_short_run_lowers_the_loss",
         "apps/test_pipeline.py::test_two_pipeline_ranks_give_the_sequential_runs_loss_and_gradients[False]",
         "apps/test_nccl_order.py::test_the_pipelines_exchanges_complete_under_nccls_rules[2]",
         "apps/test_run_log.py::test_the_expert_load_figure_is_readable_at_its_size_with_its_labels_and_scale",
         "skills/test_skill_docs.py",
         "skills/test_docs.py")


# Opt-in (PITH_SLOW=1 hatch test; their time in docs/testing.md): the slowest cases whose code the default run checks
# in other cases too. The benchmark harness's other modes (its fresh-process measuring stays), the 8-process
# communication order (2 and 4 processes stay), the bf16 runs of two more families, the plan-layout and
# estimate-memory sweeps over every layout, finished torchruns exiting 0 ten times, HSDP over two nodes, Qwen3.5's
# validate under cp 2.
OPT_IN = ("bench/test_multi_gpu.py",
          *(f"bench/test_train_throughput.py::test_{name}" for name in (
              "our_rows_under_each_recompute_mode", "our_rows_with_each_optimizer", "parity_mode", "grads_mode",
              "fp8_convergence_mode", "optimizer_convergence_mode", "skewed_routing", "the_skew_bias_is_calibrated")),
          "apps/test_nccl_order.py::test_the_pipelines_exchanges_complete_under_nccls_rules[8]",
          "apps/test_distributed_train.py::test_finished_torchrun_runs_exit_0_every_time",
          "apps/test_train.py::test_bf16_compute_follows_the_fp32_run_and_keeps_fp32_weights_and_optimizer_state[qwen3_5]",
          "apps/test_train.py::test_bf16_compute_follows_the_fp32_run_and_keeps_fp32_weights_and_optimizer_state[deepseek_v2]",
          "apps/test_multinode.py::test_two_nodes_train_and_resume_with_the_one_process_losses[hsdp]",
          "skills/test_plan_layout.py::test_every_layout_the_launch_table_gives_fits_as_stated",
          "skills/test_estimate_memory.py::test_each_modes_activations_under_ep_count_the_rows_exchanged",
          "skills/test_skill_scripts.py::test_validate_passes_a_layout_that_computes_the_one_process_run[--cp 2-qwen3_5")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (tests/conftest.py's QUICK)")


def pytest_collection_modifyitems(config, items):
    slow = os.environ.get("PITH_SLOW") == "1"
    for item in items:
        if item.nodeid.removeprefix("tests/").startswith(QUICK):
            item.add_marker("quick")
        if not slow and item.nodeid.removeprefix("tests/").startswith(OPT_IN):
            item.add_marker(pytest.mark.skip(reason="opt-in: PITH_SLOW=1 (tests/conftest.py's OPT_IN)"))
