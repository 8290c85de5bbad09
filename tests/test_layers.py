"""The import-layer check (tests/layers.py) holds on this tree, and catches a planted violation."""

from __future__ import annotations

from pathlib import Path

from .conftest import ROOT
from .layers import PACKAGES, violations


def test_the_tree_keeps_the_design_layers() -> None:
    assert violations(ROOT) == []


def test_a_planted_violation_is_named_with_its_line(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "ingest" / "app.py").write_text("import os\n\ndef f():\n    from workers.engine import Engine\n")
    (tmp_path / "encoders" / "chat.py").write_text("import redis\n")
    (tmp_path / "encoders" / "wire.py").write_text("import redis\n")  # the one wire module may
    (tmp_path / "shared" / "ir.py").write_text("from ingest import app\n")
    assert violations(tmp_path) == [
        "shared/ir.py:1: shared imports ingest",
        "encoders/chat.py:1: encoders imports redis",
        "ingest/app.py:4: ingest imports workers",
    ]


def test_a_protocol_parser_doing_io_is_named(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "ingest" / "parsers").mkdir()
    (tmp_path / "ingest" / "parsers" / "chat.py").write_text("from redis.asyncio import Redis\n")
    (tmp_path / "ingest" / "http.py").write_text("from redis.asyncio import Redis\n")  # the rest of ingest may
    assert violations(tmp_path) == ["ingest/parsers/chat.py:1: ingest/parsers imports redis"]
