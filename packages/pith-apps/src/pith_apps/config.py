"""Reading Hugging Face style config.json files into typed model configs, with errors a user can act on.

Every problem raises ConfigError with a message that names the bad value and what would be valid; the
training app prints that one line and exits non-zero.
"""
import dataclasses
import json
import os
import typing
from pathlib import Path


class ConfigError(ValueError):
    """A user-facing problem with a config, a path or a flag."""


class NonFinite(ConfigError):
    """The loss, gradients or weights became non-finite, or the model dead; train() adds where to continue from
    (RunFolder.way_back): a checkpoint from before step `before`, those from it on holding the weights that failed."""

    def __init__(self, line: str, before: int):
        super().__init__(line)
        self.before = before


def write_problem(folder: Path) -> str | None:
    """Why a file cannot be written in folder (made when missing), tried with one of our own; None: it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


def read_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a JSON object, not {type(data).__name__}")
    return data


def _check_type(name: str, value, kind, may_be_zero: bool):
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str),
          list: isinstance(value, list)}[kind]
    if not ok:
        raise ConfigError(f"config value {name}={value!r} must be of type {kind.__name__}")
    if kind is int and value < (0 if may_be_zero else 1):
        raise ConfigError(f"config value {name}={value} must be {'>= 0' if may_be_zero else 'a positive integer'}")
    if kind is float and value < 0:
        raise ConfigError(f"config value {name}={value} must be >= 0")


def text_config(data: dict) -> dict:
    """A released multimodal model's config (Qwen3.5-MoE: model_type qwen3_5_moe) -> its language model's
    (text_config, model_type qwen3_5_moe_text), which is what Pith trains; any other config as it is."""
    if data.get("model_type") == "qwen3_5_moe" and isinstance(data.get("text_config"), dict):
        return {"model_type": "qwen3_5_moe_text", **data["text_config"]}
    return data


def config_from_dict(cls, data: dict, model_type: str):
    """Build dataclass `cls` from a config.json dict: keys it does not know are ignored (HF configs carry
    many), known ones are type-checked (ints positive, or >= 0 where the default is 0; floats >= 0), null
    means unset (transformers writes null for values it leaves at their default), and required ones must
    be there."""
    if data.get("model_type", model_type) != model_type:
        raise ConfigError(f"config model_type={data['model_type']!r} does not match this model; expected {model_type!r}")
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        args = typing.get_args(hints[field.name])
        kind = next(k for k in args if k is not type(None)) if type(None) in args else hints[field.name]   # int | None -> int
        if data.get(field.name) is not None:
            _check_type(field.name, data[field.name], typing.get_origin(kind) or kind, may_be_zero=field.default == 0)
            values[field.name] = data[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"config is missing required value '{field.name}' for model_type {model_type!r}")
    return cls(**values)


def require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def flops_per_token(p: dict, seq: int, routed: float | None = None) -> float:
    """Training FLOPs per token of a Hugging Face config of the families at sequence length seq: 6 per matmul
    weight a token passes through (attention, router, routed and shared experts, LM head), plus the causal
    attention scores (a sliding-window layer's only up to its window). MFU's numerator. routed: the routed experts
    a token passes through, on average (fewer than num_experts_per_tok where slots were absent; default that)."""
    h, heads, layers = p["hidden_size"], p["num_attention_heads"], p["num_hidden_layers"]
    p = p | {"num_experts_per_tok": p["num_experts_per_tok"] if routed is None else routed}
    if p["model_type"] == "qwen3_5_moe_text":
        return qwen3_5_flops_per_token(p, seq)
    if p["model_type"] == "deepseek_v2":
        qk_dim, v_dim = p["qk_nope_head_dim"] + p["qk_rope_head_dim"], p["v_head_dim"]
        attention = (h * heads * qk_dim + h * (p["kv_lora_rank"] + p["qk_rope_head_dim"])
                     + p["kv_lora_rank"] * heads * (p["qk_nope_head_dim"] + v_dim) + heads * v_dim * h)
        experts, width = p["n_routed_experts"], p["moe_intermediate_size"]
        active = p["num_experts_per_tok"] + p["n_shared_experts"]
        dense_layers = p["first_k_dense_replace"]
    else:
        head_dim, kv_heads = p["head_dim"], p["num_key_value_heads"]
        qk_dim = v_dim = head_dim
        attention = h * head_dim * (2 * heads + 2 * kv_heads)
        experts = p.get("num_experts") or p["num_local_experts"]
        width = p["moe_intermediate_size"] if p["model_type"] == "qwen3_moe" else p["intermediate_size"]
        active, dense_layers = p["num_experts_per_tok"], 0
    moe = 3 * h * width * active + h * experts
    dense = 3 * h * p.get("intermediate_size", 0)
    weights = layers * attention + dense_layers * dense + (layers - dense_layers) * moe + h * p["vocab_size"]
    window = p.get("sliding_window")
    keys = [min(seq / 2, window) if kind == "sliding_attention" and window else seq / 2
            for kind in p.get("layer_types", ["full_attention"] * layers)]   # mean keys a query attends to
    return 6 * weights + 6 * sum(keys) * heads * (qk_dim + v_dim)


def qwen3_5_layer_types(p: dict) -> list[str]:
    """Qwen3.5-MoE's layer kinds: the config's layer_types, else every full_attention_interval-th layer (default
    every 4th) full attention and the others linear attention, as transformers fills them in."""
    interval = p.get("full_attention_interval") or 4
    return p.get("layer_types") or [("linear_attention", "full_attention")[(n + 1) % interval == 0]
                                    for n in range(p["num_hidden_layers"])]


def qwen3_5_flops_per_token(p: dict, seq: int) -> float:
    """flops_per_token for Qwen3.5-MoE: a full-attention layer's projections (q with its gate) and causal scores;
    a linear-attention layer's projections and, per value head, the delta rule's three d_k x d_v products per token
    (reading the state with k and q, writing u k^T), counted like matmul weights."""
    h, heads, head_dim = p["hidden_size"], p["num_attention_heads"], p["head_dim"]
    full = h * head_dim * (3 * heads + 2 * p["num_key_value_heads"])
    k_width = p["linear_num_key_heads"] * p["linear_key_head_dim"]
    v_heads, v_width = p["linear_num_value_heads"], p["linear_num_value_heads"] * p["linear_value_head_dim"]
    linear = h * (2 * k_width + 3 * v_width + 2 * v_heads) + 3 * v_heads * p["linear_key_head_dim"] * p["linear_value_head_dim"]
    kinds = qwen3_5_layer_types(p)
    moe = h * (3 * p["moe_intermediate_size"] * p["num_experts_per_tok"] + p["num_experts"]
               + 3 * p["shared_expert_intermediate_size"] + 1)
    weights = sum(full if kind == "full_attention" else linear for kind in kinds) + len(kinds) * moe + h * p["vocab_size"]
    return 6 * weights + 6 * kinds.count("full_attention") * seq / 2 * heads * 2 * head_dim
