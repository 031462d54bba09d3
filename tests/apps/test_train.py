import subprocess
import sys

import pytest
import torch

import pith_apps.train as train_app
from pith_apps.data import DEFAULT_CORPUS, ByteTokenizer, batch_at, load_token_stream

QUICK = ["--steps", "60", "--batch-size", "8", "--seq-len", "64", "--warmup", "10", "--quiet"]


@pytest.mark.parametrize("model", list(train_app.MODELS))
def test_short_run_lowers_the_loss(model, tmp_path):
    losses = train_app.train(train_app.parse_args([model, "--out", str(tmp_path), *QUICK]))
    # Untrained, the byte model is near uniform over 257 tokens: ln 257 = 5.55 nats. 60 steps on the
    # default corpus must at least halve that (seen for qwen3: 5.51 -> 2.06).
    assert abs(losses[0] - 5.55) < 0.15
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]
    assert (tmp_path / "checkpoints" / "latest").is_file() and any((tmp_path / "tb").iterdir())


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


@pytest.mark.parametrize("model,preset", [(m, p.stem.removeprefix(f"{m}_")) for m in train_app.MODELS
                                          for p in sorted(train_app.PRESETS.glob(f"{m}_*.json"))])
def test_every_preset_is_a_valid_config(model, preset):
    cfg = train_app.model_config(train_app.parse_args([model, "--preset", preset]))
    assert cfg.vocab_size >= 257 and cfg.num_hidden_layers >= 2


def test_batches_are_a_pure_function_of_seed_and_step():
    stream = load_token_stream(DEFAULT_CORPUS, ByteTokenizer())
    a, b = batch_at(stream, 7, 0, 4, 32), batch_at(stream, 7, 0, 4, 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])
    assert not torch.equal(a[0], batch_at(stream, 8, 0, 4, 32)[0])


@pytest.mark.parametrize("argv,named", [
    (["llama"], "unknown model 'llama'; valid models: qwen3, deepseek_v2, gpt_oss"),
    (["qwen3", "--data", "/no/such/file.txt"], "dataset path '/no/such/file.txt' does not exist"),
    (["qwen3", "--preset", "huge"], "unknown --preset 'huge' for qwen3; valid presets: 30b-a3b, tiny"),
    (["qwen3", "--config", "BAD_CONFIG"], "config value num_experts=0 must be a positive integer"),
    (["qwen3", "--ep", "2"], "pp x dp x cp x ep = 1 x 1 x 1 x 2 = 2, but the world has 1 processes"),
])
def test_bad_input_ends_with_one_clear_line(argv, named, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "qwen3_moe", "vocab_size": 257, "hidden_size": 8, "num_hidden_layers": 1, '
                   '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, '
                   '"moe_intermediate_size": 8, "num_experts": 0, "num_experts_per_tok": 1}')
    argv = [str(bad) if a == "BAD_CONFIG" else a for a in argv]
    result = subprocess.run([sys.executable, "-m", "pith_apps.train", *argv, "--out", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pith-train: error: {named}")
