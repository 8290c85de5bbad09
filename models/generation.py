"""The operator's sampling defaults for the served model: the middle layers of `shared.ir.resolve()`.

Owns: reading `--generation-config FILE|auto|none` and the per-field `--default-*` flags into one
mapping of defaults (operator flags over the generation config), and the defaults we ship for the
default model, whose GGUF carries no generation config. Must not: read the environment (Settings
does) or know any request; a request's own values win over all of this in `resolve()`.

`--generation-config`:
  auto  the model folder's generation_config.json sampling fields; when it has none and the model is
        the default one, SHIPPED_DEFAULTS (SmolLM2-135M-Instruct's model card: temperature 0.2, top_p 0.9)
  none  no generation config: only the flags, then shared.ir.FALLBACK
  FILE  a generation_config.json of the operator's choosing (same fields as transformers' own)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.files import DEFAULT_SAMPLING
from shared.settings import DEFAULT_MODEL, Settings

GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# The recommended sampling of the default model, from the SmolLM2 model card (its GGUF has no config;
# models.files also writes them into its converted folder, so folders made from it keep them).
SHIPPED_DEFAULTS: dict[str, dict[str, float | int]] = {DEFAULT_MODEL: dict(DEFAULT_SAMPLING)}
# Settings field → the sampling field it sets by default (`--default-temperature` ...).
FLAG_FIELDS = {
    "default_temperature": "temperature",
    "default_top_p": "top_p",
    "default_top_k": "top_k",
    "default_min_p": "min_p",
    "default_repetition_penalty": "repetition_penalty",
    "default_max_tokens": "max_tokens",
}


def generation_fields(config: dict[str, Any]) -> dict[str, float | int]:
    """The sampling fields of a generation_config.json (none when it says `do_sample: false`)."""
    if config.get("do_sample", True) is False:
        return {}
    return {k: config[k] for k in GENERATION_KEYS if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}


def from_generation_config(settings: Settings, folder_defaults: dict[str, float | int]) -> dict[str, float | int]:
    """The generation-config layer. `folder_defaults`: what the model folder's own config holds."""
    choice = settings.generation_config
    if choice == "none":
        return {}
    if choice == "auto":
        return dict(folder_defaults) or dict(SHIPPED_DEFAULTS.get(settings.model, {}))
    path = Path(choice)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config {choice}: not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config {choice}: expected a JSON object")
    return generation_fields(config)


def sampling_defaults(settings: Settings, folder_defaults: dict[str, float | int]) -> dict[str, float | int]:
    """Operator flags over the generation config: what `resolve()` uses where a request sets nothing."""
    return from_generation_config(settings, folder_defaults) | flag_defaults(settings)


def operator_defaults(settings: Settings) -> dict[str, float | int]:
    """What a gateway worker fills in: the `--default-*` flags over a `--generation-config FILE`. `auto`
    adds nothing (the model's own defaults are the upstream's, which it applies to what stays unset)."""
    chosen = {} if settings.generation_config == "auto" else from_generation_config(settings, {})
    return chosen | flag_defaults(settings)


def flag_defaults(settings: Settings) -> dict[str, float | int]:
    """The `--default-*` flags the operator set."""
    return {name: value for field, name in FLAG_FIELDS.items() if (value := getattr(settings, field)) is not None}
