"""`./dev test`'s xdist scheduler (tests/conftest.py): a module's tests stay on one worker, the modules of a
shared group go together, and the costliest scope left (by tests/durations.json) goes out first. The node
ids are real modules' (the groups are read from their source); the durations are the test's own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests import conftest

MANY, LONG, SOME = "tests/ingest/test_auth.py", "tests/workers/test_exactness.py", "tests/cli/test_top.py"
AGENTS = ("tests/e2e/test_agent_clis.py", "tests/e2e/test_agent_fixtures.py")  # the "agents" group
COLLECTION = [
    *(f"{MANY}::test_{i}" for i in range(30)),  # the most tests, cheap
    f"{LONG}::test_a",
    f"{LONG}::test_b",
    *(f"{SOME}::test_{i}" for i in range(5)),
    *(f"{module}::test_{i}" for module in AGENTS for i in range(4)),
]
RECORDED = {MANY: 4.0, LONG: 300.0, SOME: 20.0, AGENTS[0]: 150.0, AGENTS[1]: 100.0}


class Node:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[list[int]] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.append(indexes)

    def shutdown(self) -> None:
        pass


def scheduled(recorded: dict[str, float], monkeypatch: pytest.MonkeyPatch) -> list[list[set[str]]]:
    """The modules of each batch each worker was handed at the start, with `recorded` as the durations file."""
    monkeypatch.setattr(conftest, "recorded_durations", lambda: recorded)
    options: dict[str, Any] = {"tx": ["2*popen"], "numprocesses": 2}
    config = SimpleNamespace(getvalue=options.get, getoption=options.get, option=SimpleNamespace(loadscopereorder=True))
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)  # type: ignore[arg-type]
    nodes = [Node("gw0"), Node("gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    return [[{COLLECTION[i].split("::")[0] for i in batch} for batch in node.sent] for node in nodes]


def test_the_costliest_scope_goes_out_first_whatever_its_test_count(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = scheduled(RECORDED, monkeypatch)
    assert first[0] == {LONG}  # xdist's own order (most tests first) sends test_auth.py first
    assert second[0] == set(AGENTS)  # the group's 250 s together, next
    assert all(len(batch) == 1 or batch == set(AGENTS) for batch in first + second)


def test_a_module_missing_from_the_file_counts_a_second_a_test(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = scheduled({}, monkeypatch)
    assert (first[0], second[0]) == ({MANY}, set(AGENTS))  # 30 tests, then the group's 8
    assert conftest.scope_cost(dict.fromkeys(COLLECTION, False)) == len(COLLECTION)
