"""--max-model-len past the model's window: a derived folder with YaRN (or the chosen RoPE scaling) that
transformers loads, never a silent cap; --rope-scaling none past the window is refused; --hf-overrides
merges; the default model's sampling defaults follow it into the derived folder."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from models.files import context_length, local_folder
from models.window import WindowError, describe, model_folder
from shared.settings import Settings


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(str(path))
    GenerationConfig(temperature=0.2, top_p=0.9, do_sample=True).save_pretrained(str(path))
    return path


def settings_for(folder: Path, tmp_path: Path, **changes: object) -> Settings:
    return replace(Settings(), model=str(folder), model_cache=str(tmp_path / "cache"), **changes)  # type: ignore[arg-type]


def test_within_the_window_the_folder_is_served_as_it_is(folder: Path, tmp_path: Path) -> None:
    assert model_folder(settings_for(folder, tmp_path))[1] == folder
    assert model_folder(settings_for(folder, tmp_path, max_model_len=256))[1] == folder
    assert describe(folder) == "context window 512 tokens"


def test_past_the_window_yarn_scales_rope_and_transformers_loads_it_quietly(folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    name, derived = model_folder(settings_for(folder, tmp_path, max_model_len=2048))
    assert name == "tiny" and derived != folder
    assert context_length(derived) == 2048
    config = AutoConfig.from_pretrained(str(derived))
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 512)
    assert (derived / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()  # linked, not copied
    assert GenerationConfig.from_pretrained(str(derived)).temperature == 0.2  # the sampling defaults follow
    with caplog.at_level(logging.WARNING):
        model = LlamaForCausalLM.from_pretrained(str(derived))
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()
    assert "RoPE" not in caplog.text and "rope" not in caplog.text.lower()
    assert "yarn factor 4" in describe(derived) and "2048" in describe(derived)
    again = model_folder(settings_for(folder, tmp_path, max_model_len=2048))[1]
    assert again == derived  # made once per (folder, changes)


def test_an_explicit_rope_scaling_and_hf_overrides_are_applied(folder: Path, tmp_path: Path) -> None:
    settings = settings_for(folder, tmp_path, max_model_len=1024, rope_scaling='{"type": "linear", "factor": 2}', hf_overrides='{"rms_norm_eps": 0.001}')
    derived = model_folder(settings)[1]
    config = json.loads((derived / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "linear" and config["rope_parameters"]["factor"] == 2
    assert config["rms_norm_eps"] == 0.001 and config["max_position_embeddings"] == 1024


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"max_model_len": 2048, "rope_scaling": "none"}, "--rope-scaling is none"),
        ({"max_model_len": 2048, "rope_scaling": "{yarn"}, "--rope-scaling: not JSON"),
        ({"max_model_len": 2048, "rope_scaling": '{"factor": 2}'}, "rope_type"),
        ({"hf_overrides": "[1]"}, "--hf-overrides: expected a JSON object"),
    ],
)
def test_what_cannot_be_served_is_refused_with_the_flag_and_reason(folder: Path, tmp_path: Path, changes: dict[str, object], says: str) -> None:
    with pytest.raises(WindowError, match=says.replace("[", r"\[")):
        model_folder(settings_for(folder, tmp_path, **changes))


@pytest.mark.model
def test_the_default_models_folder_carries_its_recommended_sampling(tmp_path: Path) -> None:
    settings = Settings.from_env({})
    _, converted = local_folder(settings.model, settings.model_cache)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_p"]) == (0.2, 0.9)
    derived = model_folder(replace(settings, max_model_len=32768, model_cache=settings.model_cache))[1]
    assert json.loads((derived / "generation_config.json").read_text())["temperature"] == 0.2
    assert context_length(derived) == 32768
