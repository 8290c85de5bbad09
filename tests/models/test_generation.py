"""Sampling defaults: the default model gets its model card's temperature 0.2 / top_p 0.9 (its GGUF has
no generation config), an operator can choose a generation config or none, and the precedence is
request → operator flags → generation config → FALLBACK."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from models.files import local_folder
from models.generation import operator_defaults, sampling_defaults
from models.prompt import PromptRenderer
from shared.ir import SamplingParams, apply_defaults, resolve
from shared.settings import Settings

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def default_model() -> PromptRenderer:
    settings = Settings.from_env(os.environ)
    name, folder = local_folder(settings.model, settings.model_cache)
    return PromptRenderer.load(folder, name=name, max_model_len=4096)


def test_the_default_model_samples_at_its_model_cards_temperature_and_top_p(default_model: PromptRenderer) -> None:
    # its GGUF carries none: models.files writes the model card's into the converted folder, so a folder
    # derived from it (a copy, a long-context folder) keeps them
    assert default_model.info.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    defaults = sampling_defaults(Settings(), default_model.info.sampling_defaults)
    resolved = resolve(SamplingParams(), defaults)
    assert (resolved.temperature, resolved.top_p, resolved.top_k, resolved.max_tokens) == (0.2, 0.9, 0, None)


def test_none_leaves_only_the_fallback(default_model: PromptRenderer) -> None:
    resolved = resolve(SamplingParams(), sampling_defaults(Settings(generation_config="none"), default_model.info.sampling_defaults))
    assert (resolved.temperature, resolved.top_p) == (1.0, 1.0)


def test_auto_prefers_the_model_folders_own_generation_config() -> None:
    defaults = sampling_defaults(Settings(model="/some/model"), {"temperature": 0.6, "top_k": 20})
    assert defaults == {"temperature": 0.6, "top_k": 20}
    assert sampling_defaults(Settings(model="/some/model"), {}) == {}  # not the default model: nothing shipped


def test_a_generation_config_file_and_flags_over_it(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 40, "do_sample": True, "eos_token_id": 2}))
    settings = Settings(generation_config=str(path), default_temperature=0.3, default_max_tokens=64)
    defaults = sampling_defaults(settings, {"temperature": 0.1})
    assert defaults == {"temperature": 0.3, "top_p": 0.8, "top_k": 40, "max_tokens": 64}
    request_wins = resolve(SamplingParams(temperature=0.9, max_tokens=5), defaults)
    assert (request_wins.temperature, request_wins.top_p, request_wins.top_k, request_wins.max_tokens) == (0.9, 0.8, 40, 5)


def test_a_gateway_fills_only_the_operators_layer_and_leaves_the_rest_to_the_upstream(tmp_path: Path) -> None:
    settings = Settings(default_temperature=0.3, default_max_tokens=64)  # generation config auto: the upstream's own
    assert operator_defaults(settings) == {"temperature": 0.3, "max_tokens": 64}
    filled = apply_defaults(SamplingParams(top_p=0.5), operator_defaults(settings))
    assert (filled.temperature, filled.top_p, filled.max_tokens, filled.top_k, filled.min_p) == (0.3, 0.5, 64, None, None)
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.7, "top_k": 40}))
    assert operator_defaults(Settings(generation_config=str(path), default_top_k=5)) == {"temperature": 0.7, "top_k": 5}
    assert operator_defaults(Settings(model="smollm2")) == {}  # not the default model's shipped defaults: that is the upstream's model


def test_a_greedy_generation_config_sets_no_sampling_defaults(tmp_path: Path) -> None:
    path = tmp_path / "greedy.json"
    path.write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert sampling_defaults(Settings(generation_config=str(path)), {}) == {}


def test_flags_come_from_the_environment_too() -> None:
    settings = Settings.from_env({"MET_DEFAULT_TOP_P": "0.5", "MET_DEFAULT_TOP_K": "7", "MET_GENERATION_CONFIG": "none"})
    assert sampling_defaults(settings, {"temperature": 0.4}) == {"top_p": 0.5, "top_k": 7}


def test_a_missing_generation_config_file_or_an_unknown_log_format_is_refused_at_the_command_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    missing = CliRunner().invoke(app, ["worker", "--redis-url", "redis://127.0.0.1:1/0", "--generation-config", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "--generation-config" in missing.output
    unknown = CliRunner().invoke(app, ["worker", "--redis-url", "redis://127.0.0.1:1/0", "--log-format", "xml"])
    assert unknown.exit_code == 2 and "--log-format" in unknown.output
