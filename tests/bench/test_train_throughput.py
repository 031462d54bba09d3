"""The benchmark harness (bench/train_throughput.py) on the CPU at the tiny presets: every configuration runs
in a fresh process of its own while the driver imports no torch at all, and the parity mode's two sides
(transformers and the app from the same saved weights) follow each other, and the gradient mode matches
every tensor."""
import json
import math
import runpy
import subprocess
import sys
import types
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "train_throughput.py"
TINY = ["--device", "cpu", "--preset", "tiny", "--families", "qwen3", "--layers", "1", "--seq", "32"]
# run the driver as a script, then report whether it ever imported torch
DRIVER = ("import runpy, sys; sys.argv = {argv!r}; runpy.run_path({path!r}, run_name='__main__'); "
          "print('TORCH_IMPORTED', 'torch' in sys.modules)")


def drive(tmp_path, *flags):
    argv = [str(BENCH), *TINY, *flags]
    result = subprocess.run([sys.executable, "-c", DRIVER.format(argv=argv, path=str(BENCH))], capture_output=True,
                            text=True, env={**__import__("os").environ, "OUT": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "TORCH_IMPORTED False"
    return result


def test_each_configuration_is_measured_in_a_fresh_process_of_its_own(tmp_path):
    """Each row in its own process, with its MFU against the matmul peak measured here and against the data-sheet
    peak given (--peak-tflops 0.05: the training FLOP/s over it, to the 3 digits written)."""
    from pith_apps.config import flops_per_token
    from pith_apps.options import PRESETS
    drive(tmp_path, "--steps", "3", "--accum", "1", "2", "--precision", "mixed", "--profile", "--peak-tflops", "0.05")
    table = json.loads((tmp_path / "train_throughput.json").read_text())
    rows = table["rows"]
    assert sorted((r["side"], r["accum"]) for r in rows) == [("hf", 1), ("hf", 2), ("pith", 1), ("pith", 2)]
    assert [r["attention"] for r in rows if r["side"] == "hf"] == ["sdpa", "sdpa"]
    assert all("error" not in r for r in rows), rows
    assert len({r["pid"] for r in rows}) == 4 and all(r["fresh"] for r in rows)
    assert table["peak_tflops"]["matmul_peak"] > 0 and table["peak_tflops"]["datasheet"] == 0.05
    flops = flops_per_token(json.loads((PRESETS / "qwen3_tiny.json").read_text()) | {"num_hidden_layers": 1}, 32)
    profile = (tmp_path / "profile_pith_qwen3_mixed_2.txt").read_text()   # one more step of our model, profiled
    assert "_GroupedLinearBackward" in profile and json.loads(profile.splitlines()[0])["busy_ms"] == 0.0   # no GPU
    for r in rows:
        assert r["tok_s"] > 0 and r["mfu_matmul_peak_pct"] > 0 and len(r["losses"]) == 3
        assert r["mfu_datasheet_pct"] == float(f"{100 * r['tok_s'] * flops / 0.05e12:.3g}"), r
        assert all(math.isfinite(x) and 4.0 < x < 7.0 for x in r["losses"])   # near ln(257) = 5.55 at init


def test_our_rows_under_each_recompute_mode_each_in_its_own_process(tmp_path):
    """--recompute none selective full: one row of ours per mode, each in its own process, the same losses (the
    same kernels on the same numbers)."""
    drive(tmp_path, "--steps", "3", "--accum", "2", "--precision", "mixed", "--sides", "pith", "--recompute", "none",
          "selective", "full")
    rows = json.loads((tmp_path / "train_throughput.json").read_text())["rows"]
    assert [r["recompute"] for r in rows] == ["none", "selective", "full"] and len({r["pid"] for r in rows}) == 3
    assert rows[0]["losses"] == rows[1]["losses"] == rows[2]["losses"] and len(rows[0]["losses"]) == 3, rows


def test_our_rows_with_each_optimizer_each_in_its_own_process(tmp_path):
    """--optimizer adamw muon: one row of ours per optimizer, each in its own process, the first step's loss the
    same (the same weights, before any update), the third not (two other updates: 5.5711 and 5.5722 seen)."""
    drive(tmp_path, "--steps", "3", "--accum", "2", "--precision", "mixed", "--sides", "pith", "--optimizer", "adamw",
          "muon")
    rows = json.loads((tmp_path / "train_throughput.json").read_text())["rows"]
    assert [r["optimizer"] for r in rows] == ["adamw", "muon"] and len({r["pid"] for r in rows}) == 2
    assert rows[0]["losses"][0] == rows[1]["losses"][0] and rows[0]["losses"][2] != rows[1]["losses"][2], rows


def test_parity_mode_the_app_follows_transformers_from_the_same_weights(tmp_path):
    drive(tmp_path, "--parity", "--precision", "mixed")
    (row,) = json.loads((tmp_path / "parity.json").read_text())["rows"]
    assert len(row["pith"]) == len(row["hf"]) == 20, row
    assert row["init_gap_pct"] < 1.0 and row["max_gap_pct"] < 2.0, row   # the GPU check's tolerances
    assert row["hf"][-1] < row["hf"][0] - 0.3   # both sides learn: the comparison is not of two flat lines
    # transformers from the same weights in bf16 drifts from itself in mixed precision (seen 0.6%): the scale
    assert len(row["hf_other_precision"]) == 20 and 0 < row["hf_other_precision_max_gap_pct"] < 5, row


def test_grads_mode_compares_every_gradient_with_transformers_against_its_own_bf16_drift(tmp_path):
    drive(tmp_path, "--grads")
    (row,) = json.loads((tmp_path / "grads.json").read_text())["rows"]
    tensors = row["tensors"]
    assert "error" not in row and len(tensors) == 14, row   # every tensor of the 1-layer model, each matched
    # ours against transformers' mixed precision, in the scale of transformers' bf16 against its mixed run.
    # At this size a token that routes differently moves an expert's gradient (seen: transformers against
    # itself 0.8-1.5% on most runs, 11% on one tensor once), so the median over tensors is what must agree
    # (seen: ratios up to 1.6); one token more on our side gave 3% on every tensor, a ratio near 6, and a
    # tensor in a wrong layout would be off by ~100%. The router's gradient, a sum over few tokens, can drift by
    # half of itself between transformers' own two runs (0.535 seen once): each tensor within 0.5 or 1.5x that drift
    ratios = sorted(t["pith_gap"] / t["hf_bf16_gap"] for t in tensors)
    assert ratios[len(ratios) // 2] < 3, tensors
    assert all(0 < t["hf_bf16_gap"] and t["pith_gap"] < max(0.5, 1.5 * t["hf_bf16_gap"]) for t in tensors), tensors


def test_fp8_convergence_mode_runs_our_step_with_and_without_fp8_from_the_same_weights(tmp_path):
    """The GPU check of issue 16's loss (300 steps there) at the tiny preset: both runs start from the same weights
    (first losses within 1%: only the quantization differs), learn (0.57 nats seen in these 30 steps of 64 tokens;
    the Markov text's floor, 2.50, is far below), and end within 3% (the GPU check asks 1%; the tiny CPU run is
    noisier: 0.26% seen), above the floor."""
    drive(tmp_path, "--fp8-convergence", "--steps", "30", "--lr", "3e-3", "--accum", "2")
    (row,) = json.loads((tmp_path / "fp8_convergence.json").read_text())["rows"]
    assert len(row["bf16"]) == len(row["fp8"]) == 30, row
    assert abs(row["fp8"][0] - row["bf16"][0]) < 0.01 * row["bf16"][0]
    assert row["end_bf16"] < row["bf16"][0] - 0.3 and row["end_gap_pct"] < 3.0, row
    assert row["floor"] < min(row["end_bf16"], row["end_fp8"]) and all(v > 0 for v in row["above_floor_pct"].values())


def test_optimizer_convergence_mode_runs_adamw_and_muon_at_each_learning_rate_and_names_each_ones_best(tmp_path):
    """Each optimizer at each --lrs value in its own process from the same weights, on Markov text: every run's mean
    loss over its last 10 of 20 steps is above the text's floor and not above the untrained 5.55 (within the warmup's
    30 steps the learning rate is still rising: 5.13 and 5.55 seen for AdamW, 5.06 and 4.72 for Muon), each
    optimizer's best is its lowest end, and that learned (0.3 below 5.55)."""
    drive(tmp_path, "--optimizer-convergence", "--steps", "20", "--lrs", "3e-3", "1e-2", "--accum", "2")
    (row,) = json.loads((tmp_path / "optimizer_convergence.json").read_text())["rows"]
    assert sorted(row["ends"]) == ["adamw 0.003", "adamw 0.01", "muon 0.003", "muon 0.01"], row
    assert all(row["floor"] < end < 5.6 for end in row["ends"].values()), row
    for optimizer in ("adamw", "muon"):
        best = row[f"best_{optimizer}"]
        assert best["end"] == min(end for key, end in row["ends"].items() if key.startswith(optimizer)), row
        assert best["end"] < 5.55 - 0.3, row
        assert row["ends"][f"{optimizer} {best['lr']:g}"] == best["end"]


def test_markov_text_is_new_each_step_and_its_floor_is_its_entropy_rate():
    """The FP8 check's text: no window repeats, and the chain's entropy rate (2.50 nats) is the mean, over a long
    walk, of each step's -log probability, within 1% (the walk's 400,000 steps leave ~0.2%)."""
    bench = runpy.run_path(str(BENCH))   # its functions, not its main
    chain, floor = bench["markov_chain"]()
    walk = bench["markov_windows"](100, 4001)
    assert len({tuple(window.tolist()) for window in walk}) == 100 and abs(floor - 2.5) < 0.01
    seen = -chain[walk[:, :-1], walk[:, 1:]].log().mean().item()
    assert abs(seen / floor - 1) < 0.01, (seen, floor)


def test_skewed_routing_loads_the_heaviest_expert_to_the_target_on_both_sides_and_leaves_balanced_rows_alone(tmp_path):
    """--routing balanced skewed even --skew 2 on the tiny Qwen3 (8 experts, top-2: the heaviest can take at most 4x
    the mean), 2 layers, 3 steps of 2 x 256 tokens, each row in its own process. The bias is calibrated for iid normal
    logits; the tiny router's are not quite (its experts' logits have means of +-0.1 against a spread of 0.23, tokens
    sharing a component of their hidden state), which moves each expert's share: 2.36 (ours) and 1.94 (transformers')
    seen for the target 2, so within 25% of it. Balanced rows route as before: the same losses as a run without
    --routing, the heaviest expert 1.56 and 1.72 x the mean (128 slots an expert a step), below the skewed ones.
    Even rows give every expert of every layer its 128 slots a step, exactly, on both sides."""
    flags = ("--layers", "2", "--seq", "256", "--steps", "3", "--accum", "2", "--precision", "mixed")
    drive(tmp_path, *flags, "--routing", "balanced", "skewed", "even", "--skew", "2")
    rows = {(r["side"], r["routing"]): r for r in json.loads((tmp_path / "train_throughput.json").read_text())["rows"]}
    assert sorted(rows) == [(side, routing) for side in ("hf", "pith") for routing in ("balanced", "even", "skewed")]
    assert all("error" not in r for r in rows.values()) and len({r["pid"] for r in rows.values()}) == 6, rows
    for side in ("pith", "hf"):
        balanced, skewed, even = rows[side, "balanced"], rows[side, "skewed"], rows[side, "even"]
        assert skewed["skew"] == 2.0 and len(skewed["load_max_mean_layers"]) == 2, skewed
        assert abs(skewed["load_max_mean"] / 2.0 - 1) < 0.25, skewed
        assert 1.0 < balanced["load_max_mean"] < 1.8 and balanced["load_max_mean"] < skewed["load_max_mean"], balanced
        assert even["load_max_mean_layers"] == [1.0, 1.0] and "skew" not in even, even
    drive(tmp_path, *flags)   # the default: balanced only, the same rows
    for row in json.loads((tmp_path / "train_throughput.json").read_text())["rows"]:
        assert row["routing"] == "balanced" and row["losses"] == rows[row["side"], "balanced"]["losses"], row


def test_the_skew_bias_is_calibrated_for_each_real_preset_and_both_sides_route_as_if_it_were_in_the_logits():
    """skew_bias at each real preset's experts, top-k and logit spread: a new draw of 16,384 tokens' normal logits
    with it gives the heaviest expert 4x the mean load within 5% (sampling: ~1% at these counts), expert 0 first, the
    same bias on every call. Ours (skewed_select) chooses what LoadBalance.select chooses on logits + bias, softmax
    first or not, with the same weights to 1e-6; transformers' hook (hf_route) is each tiny router's own rule: the same
    experts and weights (to 1e-6) as the router's forward."""
    import torch
    import transformers
    from pith_engine.moe import LoadBalance
    skew = runpy.run_path(str(BENCH.parent / "skew.py"))
    bench = runpy.run_path(str(BENCH))
    for family, preset in bench["REAL"].items():
        config = bench["preset_dict"](family, preset, 4)
        experts, top_k = skew["experts_of"](config)
        bias = skew["skew_bias"](config, 4.0)
        assert torch.equal(bias, skew["skew_bias"](config, 4.0)) and bias[0] == bias.max(), family
        sigma = config["initializer_range"] * config["hidden_size"] ** 0.5
        logits = sigma * torch.randn(16384, experts, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        assert abs(skew["simulated_ratio"](logits, bias.double(), top_k) / 4 - 1) < 0.05, family
    logits, bias = torch.randn(512, 8), torch.linspace(0, -1, 8)
    for on_logits, scores in ((True, logits), (False, logits.softmax(-1))):
        balance = LoadBalance(8, "global_batch", 0.0, 8)
        expected = balance.select(logits + bias if on_logits else (logits + bias).softmax(-1), 2)
        skew["skew_our_routers"](types.SimpleNamespace(layers={0: types.SimpleNamespace(is_moe=True, balance=balance)}),
                                 bias, on_logits)
        ids, weights = balance.select(scores, 2)
        assert torch.equal(ids, expected[0]) and torch.allclose(weights, expected[1], atol=1e-6), on_logits
    for family in bench["REAL"]:
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            **bench["preset_dict"](family, "tiny", 2)))
        for router in skew["hf_routers"](model):
            hidden = torch.randn(256, router.weight.shape[1])
            logits, *theirs = router(hidden)
            weights, ids = by_expert(*theirs)
            ours_weights, ours_ids = by_expert(*skew["hf_route"](router, logits))
            assert torch.equal(ids, ours_ids) and torch.allclose(weights, ours_weights, atol=1e-6), family


def by_expert(weights, ids):
    """Top-k weights and expert ids with each token's slots in expert order (DeepSeek's router leaves them unsorted)."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids
