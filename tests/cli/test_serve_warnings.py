"""`met serve` / `met api` warn at start when the API listens beyond this host with no API key."""

from __future__ import annotations

from pathlib import Path

from cli.serve import open_to_the_network
from shared.settings import Settings


def test_a_public_address_without_keys_is_warned_about_and_loopback_or_a_key_is_not(tmp_path: Path) -> None:
    warning = open_to_the_network(Settings(host="0.0.0.0", port=8000))
    assert "0.0.0.0:8000" in warning and "--api-key" in warning
    assert open_to_the_network(Settings(host="127.0.0.1")) == ""
    assert open_to_the_network(Settings(host="0.0.0.0", api_keys="sk-1")) == ""
    keys = tmp_path / "keys"
    keys.write_text("sk-2\n")
    assert open_to_the_network(Settings(host="0.0.0.0", api_keys_file=str(keys))) == ""
