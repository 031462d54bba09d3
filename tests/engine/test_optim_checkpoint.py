import copy
import math

import pytest
import torch

import pith_engine.checkpoint as checkpoint
from distributed import run_on_processes
from conftest import KERNEL_DEVICE
from pith_engine.data_parallel import clip_grad_norm, grad_norm
from pith_engine.optim import adamw, clipped_step, lr_at
from pith_ops.adamw import adamw_update


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    lrs = [lr_at(s, 1.0, warmup=10, total=110, schedule="cosine", min_ratio=0.1) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(500, 2.0, warmup=10, total=110, schedule="constant") == 2.0


def test_wsd_schedule_holds_then_decays_linearly_over_the_last_fifth():
    lrs = [lr_at(s, 1.0, warmup=10, total=100, schedule="wsd", min_ratio=0.1) for s in range(101)]
    assert lrs[9] == pytest.approx(1.0) and lrs[80] == pytest.approx(1.0)
    assert lrs[90] == pytest.approx(1.0 - 0.9 * 0.5) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = adamw(model, lr=1e-3, weight_decay=0.1).param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def two_linears(grad_scale: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * grad_scale
    return model


@pytest.mark.parametrize("use_kernel", [False, True])   # torch's fused AdamW; pith_ops' kernel
@pytest.mark.parametrize("grad_scale", [0.01, 10.0])   # norm ~0.04, below the clip; ~40, above it
def test_the_clip_inside_the_fused_step_updates_as_clipping_the_gradients_first(grad_scale, use_kernel):
    folded, first = two_linears(grad_scale), two_linears(grad_scale)
    folded_opt, first_opt = adamw(folded, 0.1, 0.1), adamw(first, 0.1, 0.1)
    folded_opt.use_kernel = use_kernel
    norm = grad_norm(folded.parameters())
    assert norm.item() == pytest.approx(math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in first.parameters())))
    for _ in range(2):   # the second step also checks that no scale is left behind on the optimizer
        clipped_step(folded_opt, grad_norm(folded.parameters()), 1.0)
        assert not any(hasattr(folded_opt, name) for name in ("grad_scale", "found_inf"))
        clip_grad_norm(first.parameters(), 1.0)
        first_opt.step()
    for a, b in zip(folded.parameters(), first.parameters()):   # a division where the reference multiplies: 1 ulp
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert not torch.allclose(folded[0].weight, two_linears(grad_scale)[0].weight, rtol=0, atol=1e-3)   # it moved


def test_the_gradient_norm_is_the_float64_norm_to_float32_rounding_however_the_gradient_is_split():
    """An LM head's gradient (vocabulary 8192 x hidden 128, from 2048 tokens' cross-entropy) whole, as one process
    holds it, and in the row quarters that four ranks of a layout hold: the norm the clip divides by is the float64
    norm within 1e-6 both ways (2.3e-8 now). torch's CPU norm of the whole tensor was 7.4e-5 off, summed over the
    quarters 3.9e-5: a layout's clipped steps differed from one process's by that (issue 41)."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Parameter(torch.randn(8192, 128, generator=generator) * 0.02)
    hidden = torch.randn(2048, 128, generator=generator)
    torch.nn.functional.cross_entropy(hidden @ head.T, torch.randint(0, 8192, (2048,), generator=generator)).backward()
    exact = head.grad.double().norm().item()
    quarters = [torch.nn.Parameter(torch.empty_like(rows)) for rows in head.grad.chunk(4)]
    for part, rows in zip(quarters, head.grad.chunk(4)):
        part.grad = rows
    for parameters in ([head], quarters):
        assert abs(grad_norm(parameters).item() - exact) < 1e-6 * exact


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_learning_rate_given_as_a_tensor_steps_every_group_as_that_lr_in_the_groups(use_kernel):
    """clipped_step's lr (what a CUDA graph of the step reads, a schedule's value copied in before each replay)
    against the same value set in both groups; the groups keep their own lr afterwards."""
    given, grouped = two_linears(1.0), two_linears(1.0)
    given_opt, grouped_opt = adamw(given, 0.5, 0.1), adamw(grouped, 0.5, 0.1)
    given_opt.use_kernel = grouped_opt.use_kernel = use_kernel
    for lr in (0.01, 0.003):
        for group in grouped_opt.param_groups:
            group["lr"] = lr
        clipped_step(given_opt, grad_norm(given.parameters()), 1.0, torch.tensor(lr))
        clipped_step(grouped_opt, grad_norm(grouped.parameters()), 1.0)
    assert [group["lr"] for group in given_opt.param_groups] == [0.5, 0.5]
    for a, b in zip(given.parameters(), grouped.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
    assert not torch.allclose(given[0].weight, two_linears(1.0)[0].weight, rtol=0, atol=1e-3)   # it moved


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_non_finite_gradient_norm_skips_the_step_and_leaves_weights_and_state_as_they_were(use_kernel):
    model = two_linears(1.0)
    optimizer = adamw(model, 0.1, 0.1)
    optimizer.use_kernel = use_kernel
    clipped_step(optimizer, grad_norm(model.parameters()), 1.0)
    weights = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    next(model.parameters()).grad[0, 0] = float("inf")
    norm = grad_norm(model.parameters())
    assert norm.item() == float("inf")
    clipped_step(optimizer, norm, 1.0)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    for p, before in zip(model.parameters(), state):
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_steps_as_torchs_fused_adamw_and_torch_continues_from_its_state(dtype):
    """Four steps with new gradients each, against torch's fused AdamW given the kernel's weights and state before
    each step after the first (so torch continues from the kernel's state, and bf16 roundings do not add up
    over the steps). fp32: within 1e-6 (a division order apart); bf16: one bf16 rounding step (2**-7 relative)."""
    models = [two_linears(1.0).to(dtype) for _ in range(2)]
    ours, torchs = adamw(models[0], 0.1, 0.1), adamw(models[1], 0.1, 0.1)
    ours.use_kernel = True
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        if step > 0:
            models[1].load_state_dict(models[0].state_dict())
            torchs.load_state_dict(copy.deepcopy(ours.state_dict()))   # else the two share the moments
        grads = [torch.randn(p.shape, generator=generator).to(dtype) for p in models[0].parameters()]
        for model in models:
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
        ours.step()
        torchs.step()
        for a, b in zip(*(model.parameters() for model in models)):
            assert a.dtype == dtype and torch.allclose(a.float(), b.float(), rtol=tolerance, atol=1e-6)
            assert ours.state[a]["step"].item() == torchs.state[b]["step"].item() == step + 1
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(ours.state[a][key].float(), torchs.state[b][key].float(), rtol=tolerance,
                                      atol=1e-8)


def test_the_kernel_writes_the_compute_copy_as_the_bf16_cast_of_the_updated_parameter():
    """adamw_update's `copy` (mixed precision's bf16 weights): the fp32 parameter after the update in bf16, which on
    CUDA is torch's cast (rounded to nearest) bit for bit; Triton's CPU interpreter truncates to bf16, so there it
    is within one bf16 step (2**-7 relative) below the magnitude. A skipped step (found_inf) leaves it as it was."""
    generator = torch.Generator().manual_seed(3)
    param, grad = (torch.randn(3000, generator=generator).to(KERNEL_DEVICE) for _ in range(2))
    moments = [torch.zeros_like(param) for _ in range(2)]
    bf16 = torch.zeros_like(param, dtype=torch.bfloat16)
    scalars = [torch.tensor(v, device=KERNEL_DEVICE) for v in (1.0, 0.1, 1.0)]   # step, lr, grad_scale
    for skip in (0.0, 1.0):
        before = bf16.clone()
        adamw_update(param, grad, *moments, *scalars[:2], (0.9, 0.95), 1e-8, 0.1, scalars[2],
                     torch.tensor(skip, device=KERNEL_DEVICE), bf16)
        if skip:
            assert torch.equal(bf16, before)
        elif KERNEL_DEVICE == "cuda":
            assert torch.equal(bf16, param.to(torch.bfloat16))
        else:
            assert (bf16.abs() <= param.abs()).all()
            assert ((param - bf16.float()).abs() <= param.abs() * 2 ** -7).all()
    assert not torch.equal(bf16.float(), torch.zeros_like(param))


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_closure_gives_the_gradients_and_the_loss_as_in_torch(use_kernel):
    models = [two_linears(0.0) for _ in range(2)]
    ours, torchs = adamw(models[0], 0.1, 0.0), torch.optim.AdamW(models[1].parameters(), 0.1, (0.9, 0.95), weight_decay=0.0)
    ours.use_kernel = use_kernel

    def closure_for(model):
        def closure():
            loss = model(torch.ones(2, 5)).square().sum()
            model.zero_grad()
            loss.backward()
            return loss
        return closure
    our_loss, torch_loss = ours.step(closure_for(models[0])), torchs.step(closure_for(models[1]))
    assert our_loss.item() == pytest.approx(torch_loss.item(), rel=1e-6)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def without_experts(model: torch.nn.Module) -> torch.nn.Module:
    """A toy model as the checkpoint reads models (pith_engine.contract.MoeModel): decoder layers, none MoE."""
    model.layers = {}
    return model


def stepped_linear():
    model = without_experts(torch.nn.Linear(3, 2))
    optimizer = adamw(model, lr=0.1, weight_decay=0.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def rank_0_fails_alone(rank, world, root):
    model, optimizer = stepped_linear()
    checkpoint.save(root, 1, model, optimizer, {"run": "r"})
    if rank == 0:   # its own writes after the ranks' shared one: the checksums
        checkpoint.checksums = lambda folder: (_ for _ in ()).throw(OSError(5, "Input/output error"))
    with pytest.raises(checkpoint.CheckpointError, match=r"could not write checkpoint '.*step-00000002' \(OSError: "
                       r"\[Errno 5\] Input/output error; .* the last good checkpoint is '.*step-00000001'"):
        checkpoint.save(root, 2, model, optimizer, {"run": "r"})


def test_a_save_that_fails_on_rank_0_alone_fails_on_every_rank_and_none_waits(tmp_path):
    """Rank 0 writes the metadata after DCP's collective save: its failure reaches rank 1 too (which once waited in
    a barrier until torchrun stopped it), and the partial step is removed."""
    run_on_processes(2, rank_0_fails_alone, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def test_an_older_checkpoint_that_cannot_be_deleted_leaves_the_save_done_with_a_warning(tmp_path, monkeypatch):
    model, optimizer = stepped_linear()
    monkeypatch.setattr(checkpoint, "prune", lambda *args: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.warns(UserWarning, match=r"step-00000001' was saved, but an older one could not be deleted "
                                         r"\(PermissionError: \[Errno 13\] Permission denied\)"):
        saved = checkpoint.save(tmp_path, 1, model, optimizer, {})
    assert checkpoint.latest(tmp_path) == saved and checkpoint.damage(saved) is None


def test_crash_during_save_keeps_the_previous_checkpoint_and_old_ones_are_pruned(tmp_path, monkeypatch):
    model = without_experts(torch.nn.Linear(3, 2))
    optimizer = adamw(model, lr=0.1, weight_decay=0.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = [p.detach().clone() for p in model.parameters()]
    checkpoint.save(tmp_path, 1, model, optimizer, {"note": "first"})

    def dies_halfway(state, checkpoint_id):
        (checkpoint_id / "__0_0.distcp").write_bytes(b"partial bytes")
        raise OSError("disk full")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.dcp, "save", dies_halfway)
        with pytest.raises(checkpoint.CheckpointError, match=r"could not write checkpoint '.*step-00000002' \(OSError: "
                           r"disk full; [0-9.]+ GB free there\); the last good checkpoint is '.*step-00000001'"):
            checkpoint.save(tmp_path, 2, model, optimizer, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]   # the partial one removed
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert checkpoint.latest(tmp_path).name == "step-00000001"
    meta = checkpoint.load(checkpoint.latest(tmp_path), model, optimizer)
    assert meta["note"] == "first" and meta["step"] == 1 and set(meta["files"]) == {".metadata", "__0_0.distcp"}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved))
    assert all(state["step"].item() == 1 for state in optimizer.state.values())
    for step in (2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, {})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]   # the newest 2
    with pytest.raises(ValueError, match=r"lacks 6 of this model's entries, e.g. \['0.weight', '0.bias', 'optimizer.0.weight.exp_avg'\]"):
        other = without_experts(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        checkpoint.load(checkpoint.latest(tmp_path), other, adamw(other, lr=0.1, weight_decay=0.0))


def saved_linear(tmp_path, steps, run):
    model = without_experts(torch.nn.Linear(3, 2))
    optimizer = adamw(model, lr=0.1, weight_decay=0.0)
    for step in steps:
        checkpoint.save(tmp_path, step, model, optimizer, {"run": run})
    return model, optimizer


def test_pruning_keeps_the_most_recent_of_this_run_and_never_another_runs(tmp_path):
    """Recency, not step number: a run that went back to step 10 keeps 60 and 20 (its newest two saves)."""
    saved_linear(tmp_path, [50], run="other")
    saved_linear(tmp_path, [10, 40, 60, 20], run="mine")
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000020", "step-00000050", "step-00000060"]
    assert checkpoint.latest(tmp_path).name == "step-00000020"


def test_pruning_keeps_the_newest_checkpoint_from_before_a_rise_while_one_is_kept(tmp_path):
    """Saves 1-6 with the loss risen from step 5 (rose_at 5: step 4's weights gave it) at saves 5 and 6: step 3 stays
    beside them, and at 7 (back down) beside 6; at 8 only the newest two do."""
    model = without_experts(torch.nn.Linear(3, 2))
    optimizer = adamw(model, lr=0.1, weight_decay=0.0)
    names = lambda: sorted(int(p.name.removeprefix("step-")) for p in tmp_path.glob("step-*"))
    for step in range(1, 9):
        checkpoint.save(tmp_path, step, model, optimizer, {"run": "mine", "rose_at": 5 if step in (5, 6) else None})
        assert names() == {5: [3, 4, 5], 6: [3, 5, 6], 7: [3, 6, 7]}.get(step, list(range(max(1, step - 1), step + 1)))


@pytest.mark.parametrize("harm,named", [
    ("truncate", r"damaged: its file __0_0.distcp has \d+ bytes, not \d+"),
    ("delete", r"damaged: its file __0_0.distcp is missing"),
    ("garble", r"damaged: its file __0_0.distcp does not match its checksum"),
    ("meta", r"incomplete or damaged: its meta.json cannot be read \(JSONDecodeError: "),
])
def test_a_damaged_checkpoint_is_named_and_the_newest_good_one_found(tmp_path, harm, named):
    model, optimizer = saved_linear(tmp_path, [1, 2], run="mine")
    newest = tmp_path / "step-00000002"
    data = newest / "__0_0.distcp"
    if harm == "truncate":
        data.write_bytes(data.read_bytes()[:-7])
    elif harm == "delete":
        data.unlink()
    elif harm == "garble":   # same size, finite bytes changed in the middle
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    else:
        (newest / "meta.json").write_text('{"step": 2, "files": ')
    with pytest.raises(checkpoint.CheckpointError, match=rf"checkpoint '{newest}' is {named}"):
        checkpoint.load(newest, model, optimizer)
    assert checkpoint.newest_good(tmp_path) == tmp_path / "step-00000001"
    assert checkpoint.load(checkpoint.newest_good(tmp_path), model, optimizer)["step"] == 1


def test_a_latest_file_that_names_no_checkpoint_is_an_error(tmp_path):
    saved_linear(tmp_path, [1], run="mine")
    (tmp_path / "latest").write_bytes(b"\x00\xffgarbage")
    with pytest.raises(checkpoint.CheckpointError, match=r"latest' names '.*', not a checkpoint folder"):
        checkpoint.latest(tmp_path)


def node_local_folders(rank, world, root):
    """Each rank saves to a folder of its own, as ranks on two nodes each see their own disk at one --out path."""
    model, optimizer = stepped_linear()
    with pytest.raises(checkpoint.CheckpointError, match=r"could not write checkpoint '.*step-00000001' \("
                       r"FileNotFoundError: rank 1's file __1_0\.distcp is not in .* as rank 0 sees it: --out must "
                       r"be one folder that every node sees"):
        checkpoint.save(root / f"node-{rank}", 1, model, optimizer, {"run": "r"})


def test_an_out_that_is_not_one_folder_for_every_rank_fails_the_save_on_every_rank(tmp_path):
    """Each rank sums the files it wrote, and rank 0 seals a checkpoint only if it sees them all: on node-local
    folders the first save fails on both ranks, no step folder is left on either, and nothing names a latest (a
    checkpoint sealed from rank 0's files alone had looked whole and failed at the resume)."""
    run_on_processes(2, node_local_folders, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node-0", "node-1"]
    assert [list(folder.iterdir()) for folder in sorted(tmp_path.iterdir())] == [[], []]
