"""Shared by the per-family model tests: build a tiny random transformers model, save it with
save_pretrained (real file names and layouts), load it into our model through hf_checkpoint, and
compare logits, loss and gradients on the same tokens."""
import json

import torch

from conftest import relative_error
from pith_apps.data import DEFAULT_CORPUS
from pith_apps.hf_checkpoint import load_hf_weights, save_hf
from pith_apps.options import PRESETS

LOGITS_TOLERANCE = 1e-5   # float32, same math, different summation order
GRAD_TOLERANCE = 1e-4


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.1):
    """Weights far from the default init, so that a misplaced norm, bias or scale shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def save_tiny_hf_model(hf_config, path, seed=0, std=0.1, attn_implementation="eager"):
    import transformers
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation,
                                                           dtype=torch.float32)
    randomize(hf_model, seed, std)
    hf_model.save_pretrained(path)
    return hf_model


def load_ours(config_cls, model_cls, path):
    model = model_cls(config_cls.from_dict(json.loads((path / "config.json").read_text())))
    load_hf_weights(model, path)
    return model


def shifted_labels(ids):
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def compare_forward_and_backward(hf_model, ours, ids, grad_names: dict[str, str]):
    """Logits, mean loss and the gradients named in grad_names (ours -> transformers' parameter name)."""
    hf_out = hf_model(input_ids=ids, labels=ids)
    logits = ours(ids)
    assert relative_error(logits.detach(), hf_out.logits.detach()) < LOGITS_TOLERANCE
    labels = shifted_labels(ids)
    loss = ours.loss_sum(ids, labels) / (labels != -100).sum()
    assert abs(loss.item() - hf_out.loss.item()) < 1e-5 * hf_out.loss.item()
    hf_out.loss.backward()
    loss.backward()
    ours_params, hf_params = dict(ours.named_parameters()), dict(hf_model.named_parameters())
    for ours_name, hf_name in grad_names.items():
        assert relative_error(ours_params[ours_name].grad, hf_params[hf_name].grad) < GRAD_TOLERANCE, ours_name


def check_export_round_trip(config_cls, model_cls, source_dir, out_dir):
    """Our export of a checkpoint re-imports bit-exactly, and transformers reproduces our logits from it."""
    import transformers
    ours = load_ours(config_cls, model_cls, source_dir)
    save_hf(ours, json.loads((source_dir / "config.json").read_text()), out_dir, max_shard_bytes=100_000)
    assert len(list(out_dir.glob("*.safetensors"))) > 1   # several shards and an index
    again = load_ours(config_cls, model_cls, out_dir)
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager")
    ids = torch.randint(0, ours.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    assert relative_error(hf_model(input_ids=ids).logits.detach(), ours(ids).detach()) < LOGITS_TOLERANCE


def bpe_tokenizer(folder, vocab_size, end_token="<|endoftext|>"):
    """A byte-level BPE tokenizer.json trained on the bundled corpus (256 byte symbols + the end token + merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(DEFAULT_CORPUS)], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[end_token], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def tiny_hf_folder(folder):
    """A tiny Qwen3-MoE folder as transformers writes it (random weights), with a 257-token tokenizer.json."""
    import transformers
    bpe_tokenizer(folder, 257)
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    preset = json.loads((PRESETS / "qwen3_tiny.json").read_text())
    save_tiny_hf_model(transformers.AutoConfig.for_model(**preset), folder)
    return folder
