"""Model names: served names, aliases (exact or fnmatch patterns), --accept-any-model, the 404 and /v1/models."""

from __future__ import annotations

import pytest

from ingest.parsers.models import ModelNames
from shared.errors import ApiError


def test_served_names_and_patterns_resolve_to_their_target_and_others_are_404() -> None:
    names = ModelNames.parse("SmolLM2", "smol,smollm", "claude-*=smollm, gpt-5=smol", accept_any=False)
    assert names.main == "smol"
    assert names.resolve("smollm") == "smollm"
    assert names.resolve("claude-opus-4-1-20250805") == "smollm"
    assert names.resolve("gpt-5") == "smol"
    assert names.resolve("gpt-5-codex") is None  # an exact alias is not a prefix
    assert names.resolve("SmolLM2") is None  # --served-model-name replaces the model's own name, as in vLLM
    with pytest.raises(ApiError) as caught:
        names.check("llama-3", "model")
    error = caught.value
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert "'llama-3'" in str(error) and "'smol'" in str(error) and "claude-*" in str(error)


def test_accept_any_model_serves_every_name_with_the_main_one() -> None:
    names = ModelNames.parse("SmolLM2", None, "", accept_any=True)
    assert names.served == ("SmolLM2",)
    assert names.resolve("anything-at-all") == "SmolLM2"
    assert names.resolve("anything-at-all", listed=True) is None  # GET /v1/models/{name} still 404s: no more models exist
    with pytest.raises(ApiError):
        names.check("anything-at-all", listed=True)
    assert ModelNames.parse("SmolLM2", None, "", accept_any=False).resolve("anything-at-all") is None


@pytest.mark.parametrize("spec", ["claude-*", "=x", "claude-*=other"])
def test_a_malformed_alias_or_one_to_an_unserved_name_is_refused_at_start(spec: str) -> None:
    with pytest.raises(ValueError, match="--model-alias"):
        ModelNames.parse("SmolLM2", None, spec, accept_any=False)


def test_an_alias_without_target_maps_to_the_main_name_and_cards_list_names_then_aliases() -> None:
    names = ModelNames.parse("SmolLM2", "a,b", "claude-*=", accept_any=False)
    assert names.resolve("claude-haiku") == "a"
    cards = names.cards({"object": "model", "owned_by": "metrale"})
    assert [c["id"] for c in cards] == ["a", "b", "claude-*"]
    assert cards[2]["parent"] == "a" and "parent" not in cards[0]
