"""`met dump`'s pure parts: --since parsing, the plain-text table, the show block."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import typer

from cli.dump import parse_since, show_text, table
from shared.dumps import DumpRecord
from shared.ir import Protocol

from ..encoders.recorded import SCENARIOS, request

NOW = 1_700_000_000.0


@pytest.mark.parametrize(("value", "seconds"), [("90s", 90), ("15m", 900), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("0.5h", 1800)])
def test_since_takes_a_duration_back_from_now(value: str, seconds: float) -> None:
    assert parse_since(value, now=NOW) == NOW - seconds


def test_since_takes_an_iso_time_in_utc_unless_it_names_a_zone() -> None:
    assert parse_since("2023-11-14T22:13:20", now=NOW) == NOW
    assert parse_since("2023-11-14T23:13:20+01:00", now=NOW) == NOW
    assert parse_since("2023-11-14", now=NOW) == datetime(2023, 11, 14, tzinfo=UTC).timestamp()


def test_since_refuses_anything_else() -> None:
    with pytest.raises(typer.BadParameter):
        parse_since("yesterday")


def test_the_table_aligns_columns() -> None:
    assert table(("ID", "STATUS"), [("a", "finished"), ("bbbb", "running")]).splitlines() == [
        "ID    STATUS",
        "a     finished",
        "bbbb  running",
    ]


def test_show_lists_timings_worker_attempt_and_outcome() -> None:
    meta = {"status": "finished", "worker": "w-1", "attempt": 2, "outcome": "stop", "received_at": NOW, "claimed_at": NOW + 0.012,
            "first_token_at": NOW + 0.25, "finished_at": NOW + 12.5}  # fmt: skip
    req = request(Protocol.OPENAI_CHAT, endpoint="/v1/chat/completions")
    text = show_text(DumpRecord(id=req.id, request=req, deltas=tuple(SCENARIOS["plain_text"]), meta=meta))
    rows = dict(line.split(None, 1) for line in text.split("\n\n")[0].splitlines()[1:] if " " in line)
    assert rows["worker"].strip() == "w-1" and rows["attempt"].strip() == "2" and rows["outcome"].strip() == "stop"
    assert "+12 ms" in text and "+250 ms" in text and "+12.5 s" in text
    assert "2023-11-14 22:13:20 UTC" in text
    assert text.endswith("output:\n  Hello, world")
