import importlib.util
import json
import math
import re
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import pith_apps.options as options
import pith_apps.train as train_app
from conftest import relative_error
from hf_compare import bpe_tokenizer, tiny_hf_folder
from pith_apps.config import ConfigError, flops_per_token
from pith_apps.data import (DEFAULT_CORPUS, ByteTokenizer, HFTokenizer, batch_at, document_ids, held_out_batch,
                             split_held_out, token_store)
from pith_apps.run_log import load_figure
from pith_engine.contract import moe_layers
from pith_engine.optim import adamw, lr_at
from pith_ops import gated_delta

QUICK = ["--steps", "60", "--batch-size", "8", "--seq-len", "64", "--warmup", "10", "--quiet"]


@pytest.mark.parametrize("model", list(train_app.MODELS))
def test_short_run_lowers_the_loss(model, tmp_path):
    losses = train_app.train(train_app.parse_args([model, "--out", str(tmp_path), *QUICK]))
    # Untrained, the byte model is near uniform over 257 tokens: ln 257 = 5.55 nats. 60 steps on the
    # default corpus must at least halve that (seen for qwen3: 5.51 -> 2.06).
    assert abs(losses[0] - 5.55) < 0.15
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]
    assert (tmp_path / "checkpoints" / "latest").is_file() and any((tmp_path / "tb").iterdir())


def test_a_busy_cpu_is_named_with_the_thread_count_to_set(tmp_path, monkeypatch, capsys):
    """More threads than the cores the load average leaves free: one line naming the load and OMP_NUM_THREADS=free
    (at least 1); as many or fewer: nothing. The app prints it before the data, and never changes the count."""
    assert train_app.busy_cpu_advice(0.3, 4, 4) is None and train_app.busy_cpu_advice(2.6, 4, 1) is None
    assert train_app.busy_cpu_advice(1.6, 4, 4).endswith("run with OMP_NUM_THREADS=2")
    assert train_app.busy_cpu_advice(7.0, 2, 2).endswith("run with OMP_NUM_THREADS=1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(train_app.os, "getloadavg", lambda: (64.0, 0.0, 0.0))
    threads = torch.get_num_threads()
    train_app.train(train_app.parse_args(["qwen3", "--out", str(tmp_path), "--steps", "1", "--batch-size", "2",
                                          "--seq-len", "16", "--save-every", "0", "--device", "cpu"]))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("the CPU is busy")]
    assert torch.get_num_threads() == threads
    assert said == ([f"the CPU is busy (load 64.0 on {len(train_app.os.sched_getaffinity(0))} cores) and this run "
                     f"uses {threads} threads: if steps are slow, run with OMP_NUM_THREADS=1"] if threads > 1 else [])


@pytest.mark.parametrize("model", list(train_app.MODELS))
def test_bf16_compute_follows_the_fp32_run_and_keeps_fp32_weights_and_optimizer_state(model, tmp_path):
    """At lr 3e-5 most AdamW updates are far below half a bf16 step of the weights: with fp32 master weights the
    bf16-compute losses stay within 5e-4 of the float32 run's at every one of 50 steps (2e-3 asserted); with
    the weights themselves in bf16 they were 6-7% off by step 50."""
    run = [model, *QUICK, "--lr", "3e-5", "--steps", "50"]
    reference = train_app.train(train_app.parse_args([*run, "--out", str(tmp_path / "fp32"), "--dtype", "float32"]))
    mixed = train_app.train(train_app.parse_args([*run, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]))
    assert reference[-1] < reference[0] - 0.3   # the run does learn
    assert max(abs(a - b) / a for a, b in zip(reference, mixed)) < 2e-3
    saved = dcp.FileSystemReader(tmp_path / "bf16" / "checkpoints" / "step-00000050").read_metadata().state_dict_metadata
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.experts.3.down_proj",
                 "optimizer.lm_head.weight.exp_avg_sq"):
        assert saved[name].properties.dtype == torch.float32, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the device machine)")
@pytest.mark.parametrize("model,fp8,micro_batches,capacity", [(model, False, 1, None) for model in train_app.MODELS] +
                         [("qwen3", True, 1, None), ("qwen3", False, 2, None), ("qwen3", False, 1, 0.5),
                          ("gpt_oss", False, 2, 0.5)])
def test_the_replayed_cuda_graph_step_trains_and_evaluates_as_the_eager_step(model, fp8, micro_batches, capacity):
    """On one GPU the app replays its step as a CUDA graph from step 3. train_on's loop (without its TensorBoard
    log), eagerly and through step_graph: the losses of 8 steps under a warmup schedule (the lr changes each step)
    and held-out losses evaluated before the capture and between replays (the bf16 copies of the weights and,
    with --fp8, their FP8 blocks made afresh; with 2 micro-batches the copies kept and written by AdamW) match within
    1e-4 (atomic adds in the embedding's backward). capacity: --capacity-factor, slots over it absent (fewer experts
    for some tokens, the buffers still full-size)."""
    args = train_app.parse_args([model, *QUICK, "--steps", "8", "--warmup", "8", "--eval-batches", "2", "--device",
                                 "cuda", "--allow-slow-delta-rule",   # qwen3_5: fla-core's kernels where they run
                                 "--micro-batch-size", str(8 // micro_batches), *(["--fp8", "all"] if fp8 else [])])
    train_app.check_args(args)
    stream = torch.tensor(ByteTokenizer().encode(DEFAULT_CORPUS.read_text()))
    stream, held_out = split_held_out(stream, args.eval_batches, args.batch_size, args.seq_len)
    runs = []
    for graphed in (True, False):
        parallel, device = train_app.layout(args)
        net = train_app.build_model(train_app.MODELS[model][1], options.model_config(args), parallel, device,
                                    torch.bfloat16, args.seed, args.seq_len, args.balance, micro_batches,
                                    capacity_factor=capacity)
        args.cuda_graph = graphed
        optimizer, graph = train_app.prepare_step(args, parallel, device, net)   # compiled, FP8, copies kept
        losses, evals = [], []
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args.lr, args.warmup, args.steps, args.schedule)
            ids, labels = batch_at(stream, step, args.seed, args.batch_size, args.seq_len)
            losses.append(train_app.train_step(args, parallel, device, net, optimizer, step + 1, ids, labels,
                                               graph)[0])
            if step % 3 == 1:
                evals.append(train_app.evaluate(args, parallel, device, net, held_out))
        runs.append((losses, evals, graph))
    (graph_losses, graph_evals, graph), (eager_losses, eager_evals, _) = runs
    assert graph.graph is not None and len(graph_evals) == 3   # captured, and evaluated before and between replays
    assert graph_losses == pytest.approx(eager_losses, rel=1e-4) and graph_evals == pytest.approx(eager_evals, rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the weight-gradient kernel adds into .grad on CUDA")
@pytest.mark.parametrize("model", list(train_app.MODELS))
def test_paired_expert_weight_gradients_sum_as_one_micro_batch_at_a_time(model, monkeypatch):
    """3 micro-batches a step: the app's step adds the first two micro-batches' expert weight gradients in one
    kernel pass and the third's alone (WgradPairs), one paired and one lone pass per expert weight. The
    gradients the optimizer then steps on match those of adding each micro-batch alone within 1e-6 (the same
    fp32 sums in another order)."""
    import pith_ops.grouped_gemm as grouped_gemm
    passes, add = [], grouped_gemm.add_wgrad_into
    monkeypatch.setattr(grouped_gemm, "add_wgrad_into", lambda *a, paired=None: (passes.append(paired is not None),
                                                                                 add(*a, paired=paired)))
    args = train_app.parse_args([model, *QUICK, "--steps", "1", "--batch-size", "3", "--micro-batch-size", "1",
                                 "--device", "cuda", "--no-cuda-graph", "--allow-slow-delta-rule"])
    train_app.check_args(args)
    ids, labels = batch_at(torch.tensor(ByteTokenizer().encode(DEFAULT_CORPUS.read_text())), 0, args.seed,
                           args.batch_size, args.seq_len)
    grads = []
    for paired in (True, False):
        parallel, device = train_app.layout(args)
        net = train_app.build_model(train_app.MODELS[model][1], options.model_config(args), parallel, device,
                                    torch.bfloat16, args.seed, args.seq_len, args.balance, 3)
        experts = [layer.experts for layer in moe_layers(net)]
        assert all(e.wgrad_pairs is net.wgrad_pairs is not None for e in experts)
        if not paired:
            for module in (net, *experts):
                module.wgrad_pairs = None
        optimizer = adamw(net, args.lr, args.weight_decay)
        optimizer.register_step_pre_hook(lambda opt, *_: grads.append({n: p.grad.clone() for n, p in
                                                                       net.named_parameters()}))
        passes.clear()
        train_app.train_step(args, parallel, device, net, optimizer, 1, ids, labels)
        weights = 2 * len(experts)
        assert passes == ([True] * weights + [False] * weights if paired else [False] * 3 * weights)
    for name, grad in grads[0].items():
        assert relative_error(grad, grads[1][name]) < 1e-6, name


def test_resume_after_a_crash_repeats_the_uninterrupted_run_exactly(tmp_path, monkeypatch):
    args = ["qwen3", *QUICK, "--steps", "30", "--save-every", "10"]
    straight = train_app.train(train_app.parse_args([*args, "--out", str(tmp_path / "a")]))

    def crash_at_step_25(stream, step, *rest):
        if step == 25:
            raise KeyboardInterrupt("simulated crash")
        return batch_at(stream, step, *rest)
    monkeypatch.setattr(train_app, "batch_at", crash_at_step_25)
    with pytest.raises(KeyboardInterrupt):
        train_app.train(train_app.parse_args([*args, "--out", str(tmp_path / "b")]))
    monkeypatch.setattr(train_app, "batch_at", batch_at)
    resumed = train_app.train(train_app.parse_args([*args, "--out", str(tmp_path / "b"), "--resume"]))
    # float32 on CPU, same batches (a pure function of seed and step), same state: bit-identical losses
    assert resumed == straight[20:]
    # TensorBoard: the crashed run logged steps 1-24, the resumed one 21-30 after purging 21-24: each step once
    curve = tensorboard_events(tmp_path / "b" / "tb").Scalars("train/loss")
    assert [e.step for e in curve] == list(range(1, 31))
    assert [e.value for e in curve] == [float(np.float32(x)) for x in straight]


@pytest.mark.parametrize("model,preset", [(m, p) for m in train_app.MODELS for p in options.preset_names(m)])
def test_every_preset_is_a_valid_config(model, preset):
    cfg = train_app.model_config(train_app.parse_args([model, "--preset", preset]))
    assert cfg.vocab_size >= 257 and cfg.num_hidden_layers >= 2


@pytest.mark.parametrize("model", list(train_app.MODELS))
def test_layers_grows_a_tiny_preset_by_repeating_its_pattern(model):
    """--layers 5 on a 2- or 3-layer tiny preset, a run from scratch: 5 layers, GPT-OSS's sliding and full attention
    alternating on, DeepSeek-V2's dense first layer still the only dense one."""
    tiny = train_app.model_config(train_app.parse_args([model]))
    grown = train_app.model_config(train_app.parse_args([model, "--layers", "5"]))
    assert tiny.num_hidden_layers < 5 == grown.num_hidden_layers
    if model == "gpt_oss":
        assert grown.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    layers = train_app.MODELS[model][1](grown).layers.values()
    assert sum(not layer.is_moe for layer in layers) == (model == "deepseek_v2")


@pytest.mark.parametrize("model,preset", [("qwen3", "30b-a3b"), ("deepseek_v2", "lite"), ("gpt_oss", "20b")])
def test_layers_cuts_a_real_preset_to_its_first_layers(model, preset):
    full = train_app.model_config(train_app.parse_args([model, "--preset", preset]))
    cut = train_app.model_config(train_app.parse_args([model, "--preset", preset, "--layers", "4"]))
    assert cut.num_hidden_layers == 4 and cut.hidden_size == full.hidden_size and cut.vocab_size == full.vocab_size
    if model == "gpt_oss":
        assert cut.layer_types == full.layer_types[:4]
    with torch.device("meta"):   # the real width, without allocating it
        layers = train_app.MODELS[model][1](cut).layers.values()
    assert len(layers) == 4 and sum(layer.is_moe for layer in layers) == 4 - (model == "deepseek_v2")


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path):
    stream = token_store(DEFAULT_CORPUS, ByteTokenizer(), cache=tmp_path)
    a, b = batch_at(stream, 7, 0, 4, 32), batch_at(stream, 7, 0, 4, 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])
    assert not torch.equal(a[0], batch_at(stream, 8, 0, 4, 32)[0])


@pytest.mark.parametrize("argv,named", [
    (["llama"], "unknown model 'llama'; valid models: qwen3, deepseek_v2, gpt_oss, qwen3_5"),
    (["qwen3", "--data", "/no/such/file.txt"], "dataset path '/no/such/file.txt' does not exist"),
    (["qwen3", "--preset", "huge"], "unknown --preset 'huge' for qwen3; valid presets: 30b-a3b, tiny"),
    (["qwen3", "--config", "BAD_CONFIG"], "config value num_experts=0 must be a positive integer"),
    (["qwen3", "--ep", "2"], "pp x dp x cp x ep = 1 x 1 x 1 x 2 = 2, but the world has 1 processes"),
    (["qwen3", "--micro-batch-size", "3"], "--micro-batch-size=3 does not divide the 16 sequences of each data rank"),
    (["qwen3", "--init", "INIT_DIR", "--layers", "3"], "--layers=3 must be at most the --init model's "
                                                       "num_hidden_layers=1 (its weights hold no more layers)"),
    (["deepseek_v2", "--layers", "1"], "all 1 layers of the model are dense, none MoE; raise --layers"),
    (["qwen3", "--cuda-graph", "--device", "cpu"], "--cuda-graph needs CUDA and one process (here --device cpu, 1 "),
])
def test_bad_input_ends_with_one_clear_line(argv, named, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "qwen3_moe", "vocab_size": 257, "hidden_size": 8, "num_hidden_layers": 1, '
                   '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, '
                   '"moe_intermediate_size": 8, "num_experts": 0, "num_experts_per_tok": 1}')
    argv = [{"BAD_CONFIG": str(bad), "INIT_DIR": str(tmp_path)}.get(a, a) for a in argv]
    result = subprocess.run([sys.executable, "-m", "pith_apps.train", *argv, "--out", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pith-train: error: {named}")


def test_help_explains_every_flag_in_full_sentences():
    parser = options.build_parser()
    assert parser.description.endswith(".") and parser.description[0].isupper()
    for action in parser._actions[1:]:   # after -h, which argparse writes
        assert action.help and action.help[0].isupper() and action.help.endswith("."), action.dest


def test_run_config_file_sets_the_flags_and_the_command_line_overrides_it(tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text('model = "gpt_oss"\nsteps = 5\nbatch-size = 4\nlr = 1\nquiet = true\ndtype = "float32"\n')
    args = train_app.parse_args(["--run-config", str(run), "--steps", "7"])
    assert (args.model, args.steps, args.batch_size, args.lr, args.quiet, args.dtype) == \
        ("gpt_oss", 7, 4, 1.0, True, "float32")
    assert (args.seq_len, args.preset) == (128, "tiny")   # flags in neither keep their defaults
    train_app.main(["--run-config", str(run), "--steps", "7", "--print-config"])
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    keys = {line.split(" = ")[0] for line in printed.read_text().splitlines()}
    assert not {"data", "device", "data-cache", "data-workers"} & keys   # this machine's defaults: left out
    again = train_app.parse_args(["--run-config", str(printed)])
    assert vars(again) | {"run_config": None} == vars(args) | {"run_config": None, "print_config": False}
    (tmp_path / "config.json").write_text("{}")
    for given in ("--init", "--config"):   # the model comes from there: no --preset line, which the run would not use
        printed = train_app.run_config_text(train_app.parse_args(["qwen3", given, str(tmp_path)]))
        assert "preset = " not in printed and f"{given[2:]} = " in printed, printed


@pytest.mark.parametrize("toml,argv,named", [
    ('stepz = 5', ["qwen3"], "--run-config RUN: unknown key 'stepz'; valid keys: allow-slow-delta-rule, balance, "),
    ('steps = "5"', ["qwen3"], "--run-config RUN: 'steps' = '5' must be an integer"),
    ('resume = 1', ["qwen3"], "--run-config RUN: 'resume' = 1 must be true or false"),
    ('dtype = "fp16"', ["qwen3"], "--run-config RUN: 'dtype' = 'fp16' is not one of float32, bfloat16"),
    ('steps = ', ["qwen3"], "--run-config RUN: cannot read it as TOML (Invalid value"),
    ('steps = 5', [], "no model family given; valid: qwen3, deepseek_v2, gpt_oss, qwen3_5 (as the first argument or"),
    ('', ["qwen3", "--config", "GPT_OSS"], "config 'GPT_OSS' is a gpt_oss config (model_type 'gpt_oss'), not qwen3; "
     "run: pith-train gpt_oss --config GPT_OSS"),
    ('', ["qwen3", "--init", "GPT_DIR"], "config 'GPT_DIR/config.json' is a gpt_oss config (model_type 'gpt_oss'), "
     "not qwen3; run: pith-train gpt_oss --init GPT_DIR"),
    ('', ["qwen3", "--config", "LLAMA"], "config 'LLAMA' has model_type 'llama', which Pith does not train; valid: "
     "qwen3_moe (qwen3), deepseek_v2 (deepseek_v2), gpt_oss (gpt_oss)"),
])
def test_bad_run_config_or_config_of_another_family_ends_with_one_line(toml, argv, named, tmp_path, capsys):
    run, llama = tmp_path / "run.toml", tmp_path / "llama.json"
    run.write_text(toml + "\n")
    llama.write_text('{"model_type": "llama"}')
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text((options.PRESETS / "gpt_oss_tiny.json").read_text())
    paths = {"RUN": str(run), "LLAMA": str(llama), "GPT_OSS": str(options.PRESETS / "gpt_oss_tiny.json"),
             "GPT_DIR": str(tmp_path / "gpt")}
    argv = [paths.get(a, a) for a in argv]
    with pytest.raises(SystemExit) as stop:
        train_app.main([*argv, "--run-config", str(run), "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    expected = named
    for placeholder, path in paths.items():
        expected = expected.replace(placeholder, path)
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"pith-train: error: {expected}"), lines
    assert not (tmp_path / "out").exists()   # nothing written


def hide_fla_core(monkeypatch, why: str):
    """fla-core as the app would find it on a GPU: not importable ("missing"), or refusing this Triton on Hopper
    ("old-triton": 3.4 to 3.7.0 without TileLang), faked as tests/ops/test_gated_delta.py fakes them."""
    if why == "missing":
        monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)   # importing it now raises ImportError
        return
    chunk_o = types.SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=False)
    for name, module in [("fla", types.SimpleNamespace()), ("fla.ops", types.SimpleNamespace()),
                         ("fla.ops.common", types.SimpleNamespace(chunk_o=chunk_o)),
                         ("fla.ops.common.chunk_o", chunk_o),
                         ("fla.ops.gated_delta_rule", types.SimpleNamespace(chunk_gated_delta_rule=None))]:
        monkeypatch.setitem(sys.modules, name, module)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "tilelang" else find_spec(name, *rest))


@pytest.mark.parametrize("why,fix", [
    ("missing", r"fla-core is not importable \(ModuleNotFoundError: [^)]*\); pip install fla-core"),
    ("old-triton", r"fla-core refuses Triton [0-9.]+ on Hopper GPUs \(its issue 640: [^)]*\); upgrade Triton to "
                   r"3\.7\.1 or later \(torch 2\.12 or later\), or pip install tilelang")])
def test_qwen3_5_on_a_gpu_without_fla_core_stops_in_one_line_before_any_work(why, fix, tmp_path, capsys, monkeypatch):
    """torch sees a GPU (faked) where fla-core's kernels cannot run: one line naming what to install and the flag that
    accepts the torch reference, exit 2, no warning, nothing written (no run folder, no tokenized data)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hide_fla_core(monkeypatch, why)
    with pytest.raises(SystemExit) as stop, warnings.catch_warnings():
        warnings.simplefilter("error")
        train_app.main(["qwen3_5", *QUICK, "--device", "cuda", "--out", str(tmp_path / "out"), "--data-cache",
                        str(tmp_path / "cache")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert re.fullmatch(r"pith-train: error: qwen3_5 on cuda needs fla-core's delta-rule kernels: " + fix + r"; or run "
                        r"the torch reference, ~60x slower per layer, with --allow-slow-delta-rule", lines[0]), lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_allow_slow_delta_rule_lets_qwen3_5_start_on_a_gpu_without_fla_core(tmp_path, capsys, monkeypatch):
    """The same faked GPU: with the flag the checks pass (the run would start; it is a run-config key like any flag),
    and on the CPU the reference runs without it (check_args passes, fla-core not asked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hide_fla_core(monkeypatch, "missing")
    train_app.main(["qwen3_5", "--device", "cuda", "--allow-slow-delta-rule", "--print-config"])
    printed = tmp_path / "run.toml"
    printed.write_text(capsys.readouterr().out)
    assert "allow-slow-delta-rule = true" in printed.read_text().splitlines()
    args = train_app.parse_args(["--run-config", str(printed), "--device", "cuda"])
    train_app.check_args(args)
    assert args.allow_slow_delta_rule
    monkeypatch.setattr(options, "fla_missing", lambda: pytest.fail("fla-core asked about for a CPU run"))
    train_app.check_args(train_app.parse_args(["qwen3_5", "--device", "cpu"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the reference rule on a real GPU (the device machine)")
def test_on_a_gpu_without_fla_core_the_allowed_reference_trains(monkeypatch):
    """fla-core hidden on a real GPU: qwen3_5 is refused without the flag; with it the app's step trains on the torch
    reference (one warning from pith_ops saying so), 8 steps whose loss falls by more than 0.3 (on CPU: 5.55 -> 3.02)."""
    hide_fla_core(monkeypatch, "missing")
    monkeypatch.setattr(gated_delta, "FAST_RULES", {})
    argv = ["qwen3_5", *QUICK, "--steps", "8", "--warmup", "2", "--device", "cuda", "--no-compile", "--no-cuda-graph"]
    with pytest.raises(ConfigError, match="pip install fla-core"):
        train_app.one_process_step(train_app.parse_args(argv))
    args = train_app.parse_args([*argv, "--allow-slow-delta-rule"])
    step = train_app.one_process_step(args)[1]
    stream = torch.tensor(ByteTokenizer().encode(DEFAULT_CORPUS.read_text()))
    with pytest.warns(UserWarning, match="runs the torch reference on the GPU"):
        losses = [step(n + 1, *batch_at(stream, n, args.seed, args.batch_size, args.seq_len))[0] for n in range(8)]
    assert gated_delta.FAST_RULES["cuda"] is None and losses[-1] < losses[0] - 0.3, losses


def test_a_hugging_face_tokenizer_encodes_each_document_and_ends_it_with_its_end_token(tmp_path):
    docs = ["The cat sat.", "Ünïcödé and emoji 🙂 survive.", "Last one"]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    folder = bpe_tokenizer(tmp_path / "tok", 300, end_token="<|im_end|>")
    (folder / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|im_end|>"}}')   # transformers' form
    tokenizer = HFTokenizer(folder)
    assert tokenizer.vocab_size == 300 and tokenizer.eos_id == tokenizer.tokenizer.token_to_id("<|im_end|>")
    expected = [i for d in docs for i in [*tokenizer.encode(d), tokenizer.eos_id]]
    assert token_store(data, tokenizer, cache=tmp_path / "cache").tolist() == expected
    assert [tokenizer.decode(tokenizer.encode(d)) for d in docs] == docs
    assert len(expected) < sum(len(d.encode()) for d in docs)   # merges: fewer tokens than bytes


def test_training_with_a_hugging_face_tokenizer_lowers_the_loss(tmp_path):
    folder = bpe_tokenizer(tmp_path / "tok", 257)   # fits the tiny model's vocabulary
    losses = train_app.train(train_app.parse_args(["qwen3", "--tokenizer", str(folder / "tokenizer.json"),
                                                   "--out", str(tmp_path / "run"), *QUICK]))
    assert abs(losses[0] - math.log(257)) < 0.3 and losses[-1] < losses[0] - 1.5, losses


@pytest.mark.parametrize("vocab,end_token,file,config,named", [
    (300, "<|endoftext|>", "tokenizer.json", "{}", "the tokenizer (TOK) has 300 tokens, more than the model's "
     "vocab_size=257; give a config with vocab_size >= 300 or the model's own tokenizer"),
    (257, "<sep>", "tokenizer.json", "{}", "--tokenizer 'TOK': cannot tell its end-of-document token; none of "
     "<|endoftext|>, </s>, <|end_of_text|>, <eos> is in its vocabulary"),
    (257, "<|endoftext|>", "missing.json", "{}", "--tokenizer 'TOK': no such file; give a tokenizer.json or a folder"),
    (257, "<|endoftext|>", "tokenizer_config.json", "{}", "--tokenizer 'TOK' is not a tokenizer.json the tokenizers "
     "library reads"),
    (257, "<|endoftext|>", "tokenizer.json", "{bad", "config file 'DIR/tokenizer_config.json' is not valid JSON: "),
    (257, "<|endoftext|>", "tokenizer.json", '{"eos_token": "<end>"}', "--tokenizer 'TOK': the eos_token '<end>' "
     "that tokenizer_config.json beside it names is not in its vocabulary"),
])
def test_a_bad_tokenizer_ends_with_one_line(vocab, end_token, file, config, named, tmp_path, capsys):
    folder = bpe_tokenizer(tmp_path / "tok", vocab, end_token)
    (folder / "tokenizer_config.json").write_text(config)
    with pytest.raises(SystemExit) as stop:
        train_app.main(["qwen3", "--tokenizer", str(folder / file), "--out", str(tmp_path / "run"), *QUICK])
    lines = capsys.readouterr().err.strip().splitlines()
    expected = f"pith-train: error: {named.replace('TOK', str(folder / file)).replace('DIR', str(folder))}"
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith(expected), lines
    assert not (tmp_path / "run").exists()


def test_init_starts_from_a_hugging_face_folder_with_its_weights_and_tokenizer(tmp_path, capsys):
    """A tiny folder written by transformers, with a tokenizer.json: the run's first loss is that of the folder's
    weights on the first batch in the folder's tokens (not of a fresh init), and it trains."""
    from pith_apps.hf_checkpoint import load_hf_weights
    folder = tiny_hf_folder(tmp_path / "hf")
    losses = train_app.train(train_app.parse_args(["qwen3", "--init", str(folder), "--out", str(tmp_path / "run"),
                                                   *QUICK]))
    args = train_app.parse_args(["qwen3", "--config", str(folder / "config.json"), *QUICK])
    cfg = train_app.model_config(args)
    ours = train_app.MODELS["qwen3"][1](cfg)
    load_hf_weights(ours, folder)
    stream = token_store(DEFAULT_CORPUS, HFTokenizer(folder), cache=tmp_path / "cache")
    ids, labels = batch_at(stream, 0, 0, args.batch_size, args.seq_len)
    expected = (ours.loss_sum(ids, labels) / labels.numel()).item()
    fresh = train_app.train(train_app.parse_args(["qwen3", "--tokenizer", str(folder), "--steps", "1", "--out",
                                                  str(tmp_path / "fresh"), *QUICK[2:]]))
    assert abs(losses[0] - expected) < 1e-4 * expected and abs(fresh[0] - expected) > 0.1, (losses[0], expected, fresh)
    assert losses[-1] < losses[0] - 1.0
    capsys.readouterr()   # transformers' progress bars of the save
    with pytest.raises(SystemExit):
        train_app.main(["qwen3", "--init", str(folder), "--config", str(folder / "config.json")])
    assert capsys.readouterr().err.strip() == ("pith-train: error: --init DIR takes the model's config from "
                                               "DIR; leave out --config")


def write_dataset(folder, kind, docs, field="text"):
    """docs as a dataset of one kind: a .jsonl, .parquet or .arrow file (column `field`), or a folder of .txt."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder.mkdir()
    table = pa.table({field: docs, "id": list(range(len(docs)))})
    if kind == "jsonl":
        (folder / "docs.jsonl").write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    elif kind == "parquet":
        pq.write_table(table, folder / "docs.parquet")
    elif kind == "arrow":
        with pa.ipc.new_stream(str(folder / "docs.arrow"), table.schema) as writer:
            writer.write_table(table)
    else:   # two text files: a document per line
        (folder / "a.txt").write_text("\n".join(docs[:2]) + "\n")
        (folder / "b.txt").write_text("\n".join(docs[2:]) + "\n")
    return folder if kind == "txt" else next(folder.iterdir())


def test_a_folder_that_datasets_saved_is_read(tmp_path):
    """save_to_disk writes its .arrow files with two .json files beside them, which are not data."""
    import datasets
    datasets.Dataset.from_dict({"text": ["one story", "another"]}).save_to_disk(str(tmp_path / "saved"))
    tokens = token_store(tmp_path / "saved", ByteTokenizer(), cache=tmp_path / "cache")
    assert bytes(t for t in tokens.tolist() if t < 256) == b"one storyanother" and len(tokens) == 9 + 7 + 2


def test_rows_without_text_are_left_out_and_counted(tmp_path):
    rows = [{"text": "kept"}, {"text": ""}, {"id": 3}, {"text": "also kept"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = []
    tokens = token_store(tmp_path / "d.jsonl", ByteTokenizer(), cache=tmp_path / "cache", log=lines.append)
    assert bytes(t for t in tokens.tolist() if t < 256) == b"keptalso kept" and len(tokens) == 4 + 9 + 2
    assert lines[-1].endswith("; 2 of the 4 rows had no text in 'text' and were left out")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow", "txt"])
def test_jsonl_parquet_arrow_and_a_folder_of_text_files_train(kind, tmp_path):
    docs = ["Once upon a time there was a cat.", "It sat on a mat.", "The end.", "Ünïcödé 🙂 too."]
    path = write_dataset(tmp_path / "data", kind, docs, field="text" if kind == "txt" else "content")
    field = [] if kind == "txt" else ["--text-field", "content"]
    tokenizer = ByteTokenizer()
    expected = [i for d in docs for i in [*tokenizer.encode(d), tokenizer.eos_id]]
    assert token_store(path, tokenizer, "text" if kind == "txt" else "content", tmp_path / "cache").tolist() == expected
    losses = train_app.train(train_app.parse_args(["qwen3", "--data", str(path), *field, "--out", str(tmp_path / "run"),
                                                   "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                                                   "--save-every", "0", "--quiet"]))
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_a_missing_text_field_names_the_columns_in_one_line(tmp_path, capsys):
    path = write_dataset(tmp_path / "data", "parquet", ["a", "b"], field="content")
    with pytest.raises(SystemExit) as stop:
        train_app.main(["qwen3", "--data", str(path), "--out", str(tmp_path / "run"), *QUICK])
    assert stop.value.code == 2 and capsys.readouterr().err.strip() == (
        f"pith-train: error: dataset '{path}' has columns ['content', 'id'], no 'text'; name the column to train on "
        "with --text-field")


def test_fine_tune_then_export_gives_a_folder_transformers_loads_with_our_logits(tmp_path, capsys):
    import transformers
    from pith_apps.hf_checkpoint import load_hf_weights
    start, export = tiny_hf_folder(tmp_path / "hf"), tmp_path / "export"
    train_app.main(["qwen3", "--init", str(start), "--export-hf", str(export), "--out", str(tmp_path / "run"),
                    "--steps", "5", "--batch-size", "4", "--seq-len", "32", "--quiet"])
    assert f"exported the model to {export}" in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):   # transformers wrote the last
        assert (export / name).read_bytes() == (start / name).read_bytes(), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager")
    args = train_app.parse_args(["qwen3", "--init", str(export)])
    ours, before = (train_app.MODELS["qwen3"][1](train_app.model_config(args)) for _ in range(2))
    load_hf_weights(ours, export)
    load_hf_weights(before, start)
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, start_logits = ours(ids), before(ids)
        assert relative_error(theirs(input_ids=ids).logits, logits) < 1e-5   # float32: summation order only
        assert relative_error(start_logits, logits) > 1e-3   # the export holds the trained weights, not the start


def export_refusal(tmp_path, capsys, export, *flags) -> str:
    with pytest.raises(SystemExit) as stop:
        train_app.main(["qwen3", "--export-hf", str(export), "--out", str(tmp_path / "run"), "--steps", "2",
                        "--batch-size", "2", "--seq-len", "16", "--quiet", *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("pith-train: error: --export-hf "), lines
    return lines[0].removeprefix("pith-train: error: --export-hf ")


def test_an_export_that_would_lose_files_or_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    """The export replaces its folder whole: one that holds other files, the run's own folder or a part of it, the
    --init folder, or a path that cannot be written is refused in one line before anything trains."""
    (tmp_path / "file").write_text("")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    start = tiny_hf_folder(tmp_path / "start")
    capsys.readouterr()   # transformers' progress
    run = tmp_path / "run"
    for export, flags, error in [
            (tmp_path / "file" / "export", [], f"cannot be written ({tmp_path / 'file'} is a file); give another "
             "folder"),
            (tmp_path / "notes", [], "holds 'todo.txt', which the folder, replaced whole, would lose; give a new or "
             "empty folder"),
            (run, [], f"would replace the run folder {run} or part of it; give a folder of its own (one inside the "
             f"run folder is fine: {run / 'export'})"),
            *((folder, [], f"would replace the run folder {run} or part of it; give a folder of its own (one "
               f"inside the run folder is fine: {run / 'export'})") for folder in (tmp_path, run / "checkpoints" / "x")),
            (start, ["--init", str(start)], "is the --init folder the run starts from; give another folder")]:
        assert export_refusal(tmp_path, capsys, export, *flags) == f"{export} {error}"
        assert not run.exists()
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_an_export_that_fails_at_the_end_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    import pith_apps.hf_checkpoint as hf_checkpoint

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf_checkpoint, "replace_dir", disk_full)   # save_hf's last move
    assert export_refusal(tmp_path, capsys, tmp_path / "export") == (
        f"{tmp_path / 'export'}: could not write it (No space left on device); the run and its checkpoints are intact")
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()


def test_convert_refuses_a_folder_it_would_lose_files_of(tmp_path, capsys):
    """pith-convert replaces OUT whole: a file, or a folder holding anything but an earlier output of the same kind
    (the source itself, the run folder above it), is refused in one line and left as it was."""
    from pith_apps import convert
    from pith_engine import checkpoint
    train_app.main(["qwen3", "--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                    "--quiet"])
    saved = tmp_path / "run" / "checkpoints" / "step-00000001"
    (tmp_path / "file").write_text("keep me")
    for source, out, holds in [(saved, tmp_path / "run", "'.lock' and 3 more"), (saved, saved, "'.metadata' and 2 more"),
                               (tmp_path / "hf", tmp_path / "hf", "'config.json' and 2 more")]:
        if not source.exists():
            convert.main([str(saved), str(source)])
        with pytest.raises(SystemExit) as stop:
            convert.main([str(source), str(out)])
        assert stop.value.code == 2 and capsys.readouterr().err.strip() == (
            f"pith-convert: error: OUT {out} holds {holds}, which the folder, replaced whole, would lose; give a new "
            "or empty folder")
    with pytest.raises(SystemExit):
        convert.main([str(saved), str(tmp_path / "file")])
    assert capsys.readouterr().err.strip() == f"pith-convert: error: OUT {tmp_path / 'file'} is a file; give a new folder"
    assert (tmp_path / "file").read_text() == "keep me" and checkpoint.damage(saved) is None
    convert.main([str(saved), str(tmp_path / "hf")])   # an earlier export of its own is replaced
    assert capsys.readouterr().out.strip().endswith(f"wrote {tmp_path / 'hf'}")


def test_a_run_from_a_checkpoint_starts_from_its_weights_as_from_their_hugging_face_export(tmp_path):
    """--init takes a checkpoint of the app (a training one, or a weights one pith-convert made) as it takes a
    Hugging Face folder: the runs from the checkpoint, from its export and from that export converted back train
    alike (float32: the same weights, to the bit), and not as a run from scratch."""
    from pith_apps import convert
    flags = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--quiet", "--save-every", "0"]
    train_app.main(["qwen3", *flags, "--save-every", "3", "--out", str(tmp_path / "first")])
    saved = tmp_path / "first" / "checkpoints" / "step-00000003"
    convert.main([str(saved), str(tmp_path / "hf")])
    convert.main([str(tmp_path / "hf"), str(tmp_path / "weights")])
    runs = [train_app.train(train_app.parse_args(["qwen3", *flags, "--out", str(tmp_path / f"run{n}"), *start]))
            for n, start in enumerate([["--init", str(saved)], ["--init", str(tmp_path / "hf")],
                                       ["--init", str(tmp_path / "weights")], []])]
    assert runs[0] == runs[1] == runs[2] and abs(runs[0][0] - runs[3][0]) > 0.05
    lines, args = [], train_app.parse_args(["qwen3", "--init", str(tmp_path / "hf")])   # a byte-token run's export
    train_app.training_tokens(args, options.model_config(args), log=lines.append)
    assert lines[0] == (f"--init {tmp_path / 'hf'} has no tokenizer: the text is read as UTF-8 bytes (257 tokens); "
                        "give --tokenizer for the model's own")


def test_a_warmup_as_long_as_the_run_is_pointed_out(tmp_path, capsys):
    train_app.main(["qwen3", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--out", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[0] == ("--warmup 30 is not shorter than --steps 2: the learning rate "
                                                      "rises for the whole run and never reaches --lr 0.003")


def test_a_run_from_a_model_folder_is_named_after_it(tmp_path, monkeypatch):
    start = tiny_hf_folder(tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    train_app.main(["qwen3", "--init", str(start), "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--quiet"])
    assert (tmp_path / "runs" / "qwen3-my-model" / "run.json").is_file() and not (tmp_path / "runs" / "qwen3-tiny").exists()


def tensorboard_events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    events.Reload()
    return events


def assert_same_scalars(ours, theirs, tags, relative: float):
    """Each tag's scalars in two runs' TensorBoard events: logged at the same steps (at least two), values within
    `relative` of each other."""
    for tag in tags:
        got, expected = ours.Scalars(tag), theirs.Scalars(tag)
        assert [e.step for e in got] == [e.step for e in expected] and len(got) >= 2, tag
        for a, b in zip(got, expected):
            assert abs(a.value - b.value) < relative * abs(b.value), tag


def test_tensorboard_holds_the_scalars_the_held_out_loss_and_the_expert_load_pictures(tmp_path):
    """6 steps, evaluated at 3 and 6 on the corpus's last 2 global batches (held out), pictures at 3 and 6, MFU
    against a given peak. The
    logged held-out loss is that of the saved step-6 weights on those tokens, recomputed here (1e-5); the aux
    loss (Qwen3's switch loss, top_k = 2 when balanced, times coef 0.001 and 2 MoE layers) is near 0.004."""
    from pith_engine import checkpoint
    flags = ["qwen3", "--steps", "6", "--batch-size", "4", "--seq-len", "32", "--eval-every", "3", "--eval-batches", "2",
             "--image-every", "3", "--save-every", "6", "--peak-tflops", "0.05", "--quiet", "--out", str(tmp_path / "run")]
    args = train_app.parse_args(flags)
    train_app.train(args)
    events = tensorboard_events(tmp_path / "run" / "tb")
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "aux_loss", "mfu_pct"):
        assert [e.step for e in events.Scalars(f"train/{tag}")] == [1, 2, 3, 4, 5, 6], tag
    flops = flops_per_token(train_app.hf_config_data(args), 32)   # MFU against the given 0.05 TFLOP/s peak
    for speed, mfu in zip(events.Scalars("train/tokens_per_s"), events.Scalars("train/mfu_pct")):
        assert abs(mfu.value - 100 * speed.value * flops / 0.05e12) < 1e-5 * mfu.value
    assert all(0.001 < e.value < 0.012 for e in events.Scalars("train/aux_loss"))
    evals, perplexities = events.Scalars("eval/loss"), events.Scalars("eval/perplexity")
    assert [e.step for e in evals] == [e.step for e in perplexities] == [3, 6]
    assert all(abs(p.value - math.exp(e.value)) < 1e-5 * p.value for e, p in zip(evals, perplexities))
    tokens = token_store(DEFAULT_CORPUS, ByteTokenizer(), cache=tmp_path / "cache")
    held = torch.from_numpy(np.asarray(tokens[len(tokens) - 2 * 4 * 32 - 1:], dtype=np.int64))
    windows = torch.stack([held[row * 32:row * 32 + 33] for row in range(8)])
    model = train_app.MODELS["qwen3"][1](train_app.model_config(args))
    checkpoint.load(tmp_path / "run" / "checkpoints" / "step-00000006", model, train_app.adamw(model, 1e-3, 0.0))
    with torch.no_grad():
        expected = (model.loss_sum(windows[:, :-1], windows[:, 1:]) / windows[:, 1:].numel()).item()
    assert abs(evals[-1].value - expected) < 1e-5 * expected
    pictures = events.Images("experts/load")
    width, height = load_figure(torch.ones(2, 8), "").size   # the figure of 2 MoE layers x 8 experts
    assert [e.step for e in pictures] == [3, 6] and (pictures[0].width, pictures[0].height) == (width, height)
    histograms = [tag for tag in events.Tags()["histograms"] if tag.startswith("experts/load_of_layer_")]
    assert sorted(histograms) == ["experts/load_of_layer_0", "experts/load_of_layer_1"]
    assert [e.step for e in events.Histograms("experts/load_of_layer_1")] == [3, 6]
    # each layer's loads over their mean: the histogram of 8 experts sums to 8
    assert abs(events.Histograms("experts/load_of_layer_0")[0].histogram_value.sum - 8) < 1e-4


def test_training_never_reads_the_held_out_tokens_and_too_little_data_is_named():
    tokens = np.arange(1000, dtype=np.uint32)
    train, held = split_held_out(tokens, 2, 4, 16)
    assert len(held) == 2 * 4 * 16 + 1 and np.array_equal(np.concatenate([train, held]), tokens)
    seen = torch.cat([torch.cat(batch_at(train, step, 0, 4, 16)) for step in range(40)])
    assert seen.max().item() == len(train) - 1 - (len(train) - 1) % 16   # the last sample's last label
    ids, labels = held_out_batch(held, 1, 4, 16)
    assert ids[0, 0].item() == len(train) + 4 * 16 and torch.equal(ids[:, 1:], labels[:, :-1])
    with pytest.raises(ConfigError, match=r"^the dataset's 1,000 tokens cannot hold out --eval-batches 8 of 8 x 16 "
                                          r"tokens and still train; lower --eval-batches or use more data$"):
        split_held_out(tokens, 8, 8, 16)


def test_one_process_on_a_numbered_gpu_makes_it_the_current_device(monkeypatch):
    """--device cuda:1 on one process: the app sets CUDA's current device, which Triton launches, streams and
    CUDA graphs use (a machine without that GPU is faked: the test checks the call, not the GPU)."""
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(torch.device(device).index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[-1] if current else 0)
    _, device = train_app.layout(train_app.parse_args(["qwen3", "--device", "cuda:1"]))
    assert current == [1] and device == torch.device("cuda", 1)
    _, device = train_app.layout(train_app.parse_args(["qwen3", "--device", "cuda"]))
    assert current == [1] and device == torch.device("cuda", 1)   # no index: the current device, not reset


def test_doc_mask_trains_on_the_documents_as_the_model_sees_them_alone(tmp_path):
    """--doc-mask: the first loss is the fresh model's on the first batch with each token's document (1e-5), not
    the plain loss, and the run trains."""
    flags = ["qwen3", "--steps", "20", "--batch-size", "4", "--seq-len", "64", "--save-every", "0", "--quiet"]
    masked = train_app.train(train_app.parse_args([*flags, "--doc-mask", "--out", str(tmp_path / "masked")]))
    plain = train_app.train(train_app.parse_args([*flags, "--out", str(tmp_path / "plain")]))
    args = train_app.parse_args(flags)
    parallel, device = train_app.layout(args)
    model = train_app.build_model(train_app.MODELS["qwen3"][1], train_app.model_config(args), parallel, device,
                                  torch.float32, args.seed, args.seq_len)
    tokens = token_store(DEFAULT_CORPUS, ByteTokenizer(), cache=tmp_path / "cache")
    ids, labels = batch_at(tokens, 0, args.seed, args.batch_size, args.seq_len)
    docs = document_ids(ids, ByteTokenizer.eos_id)
    assert docs.max() > 0   # the batch holds several documents
    with torch.no_grad():
        expected = (model.loss_sum(ids, labels, docs) / labels.numel()).item()
    assert abs(masked[0] - expected) < 1e-5 * expected and abs(plain[0] - expected) > 1e-4 * expected
    assert masked[-1] < masked[0] - 1.0
