"""The served model's context window, as vLLM's flags set it: `--max-model-len`, `--rope-scaling`,
`--hf-overrides`.

Owns: turning the model folder (models.files.local_folder) into the folder every role loads. When the
flags change nothing, that is the folder itself. Otherwise it is a derived folder in the model cache:
every file linked to the original's (the weights are not copied), and a config.json with the changes:
- `--max-model-len N` past the model's own window W: RoPE scaled so positions up to N stay in what the
  model was trained on, YaRN with factor N / W by default (`--rope-scaling auto`), or as
  `--rope-scaling '{"rope_type": "yarn", "factor": 2}'` says (`rope_type` one of transformers' RoPE
  types); `max_position_embeddings` becomes N. `--rope-scaling none` with N past W is refused, saying
  so: a window is never cut silently, nor stretched without RoPE scaling (positions past W are garbage);
- `--hf-overrides JSON`: any config.json fields, merged last.
The derived folder keeps the original's name as the served model name, and its generation_config.json
(so the default model's sampling defaults follow it: models.files writes them into the converted folder).
Must not: load weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from models.files import context_length, local_folder
from shared.settings import Settings

DERIVED = "derived"  # the subfolder of the model cache holding derived folders


class WindowError(ValueError):
    """A flag combination that cannot be served (the message says which flag and why)."""


def model_folder(settings: Settings) -> tuple[str, Path]:
    """(served name, the folder to load) for these settings: the model's own, or one derived from it."""
    name, folder = local_folder(settings.model, settings.model_cache)
    changes = config_changes(folder, settings)
    if not changes:
        return name, folder
    _quiet_factor_notice()
    return name, derived_folder(folder, changes, Path(settings.model_cache) / DERIVED)


def describe(folder: Path) -> str:
    """The folder's window in words, for the worker's start line."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    window = context_length(folder)
    if rope.get("rope_type") in (None, "default"):
        return f"context window {window} tokens"
    native = rope.get("original_max_position_embeddings", "?")
    return f"context window {window} tokens: RoPE {rope['rope_type']} factor {rope.get('factor', '?')} over the model's own {native}"


class _FactorNotice(logging.Filter):
    """transformers warns, at every load, when a YaRN factor differs from window / original window; a
    window wider than the factor covers is the operator's choice here (the worker says it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "explicitly set RoPE scaling factor" not in record.getMessage()


def _quiet_factor_notice() -> None:
    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    if not any(isinstance(f, _FactorNotice) for f in rope_log.filters):
        rope_log.addFilter(_FactorNotice())


def config_changes(folder: Path, settings: Settings) -> dict[str, Any]:
    """The config.json fields the flags change (empty: serve the folder as it is)."""
    config = json.loads((folder / "config.json").read_text())
    native = context_length(folder)
    changes: dict[str, Any] = {}
    wanted = settings.max_model_len
    if wanted and wanted > native:
        changes["max_position_embeddings"] = wanted
        changes["rope_parameters"] = _rope(config, native, wanted, settings.rope_scaling)
    elif settings.rope_scaling not in ("auto", "none", ""):
        changes["rope_parameters"] = _rope(config, native, native, settings.rope_scaling)
    if settings.hf_overrides:
        overrides = _json_object(settings.hf_overrides, "--hf-overrides")
        changes.update(overrides)
    return changes


def _rope(config: dict[str, Any], native: int, wanted: int, spec: str) -> dict[str, Any]:
    base = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = base.get("rope_theta", config.get("rope_theta", 10000.0))
    if spec == "none":
        raise WindowError(
            f"--max-model-len {wanted} is past this model's window of {native} tokens and --rope-scaling is none: positions past "
            f"{native} were never trained. Leave --rope-scaling at auto (YaRN, factor {wanted / native:g}), give one, or lower --max-model-len."
        )
    if spec in ("auto", ""):
        chosen: dict[str, Any] = {"rope_type": "yarn", "factor": wanted / native}
    else:
        chosen = _json_object(spec, "--rope-scaling")
        if "rope_type" not in chosen and "type" in chosen:
            chosen["rope_type"] = chosen.pop("type")
        if not isinstance(chosen.get("rope_type"), str):
            raise WindowError('--rope-scaling: a JSON object with "rope_type" (e.g. {"rope_type": "yarn", "factor": 2}), auto or none')
    return {"rope_theta": theta, "original_max_position_embeddings": native, **chosen}


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise WindowError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise WindowError(f"{flag}: expected a JSON object")
    return value


def derived_folder(source: Path, changes: dict[str, Any], root: Path) -> Path:
    """A folder of links to `source`'s files with `changes` merged into its config.json; made once per
    (source, changes), under a lock so roles starting together share it."""
    key = hashlib.sha256(json.dumps([str(source.resolve()), changes], sort_keys=True).encode()).hexdigest()[:16]
    target = root / f"{source.name}-{key}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            scratch = target.with_name(target.name + ".tmp")
            if scratch.exists():
                for item in scratch.iterdir():
                    item.unlink()
            scratch.mkdir(exist_ok=True)
            for item in source.iterdir():
                if item.name != "config.json":
                    (scratch / item.name).symlink_to(item.resolve())
            config = json.loads((source / "config.json").read_text())
            (scratch / "config.json").write_text(json.dumps({**config, **changes}, indent=2))
            with contextlib.suppress(FileNotFoundError):
                os.replace(scratch, target)
    return target
