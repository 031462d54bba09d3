"""Reading Hugging Face style config.json files into typed model configs, with errors a user can act on.

Every problem raises ConfigError with a message that names the bad value and what would be valid; the
training app prints that one line and exits non-zero.
"""
import dataclasses
import json
import typing
from pathlib import Path


class ConfigError(ValueError):
    """A user-facing problem with a config, a path or a flag."""


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
