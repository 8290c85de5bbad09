"""Test-only fault injection, reachable only where a test enabled it (a flag file in the data dir).

- `crash_on` (MET_CRASH_ON): a worker exits hard (os._exit) when it takes a request containing this text.
- `fail_on` (MET_FAIL_ON): `engine.add` raises for a request containing `<fail_on>:add`, and every step
  raises while it runs a request containing `<fail_on>:step` (through `FaultyRunner`), so tests can show
  that one bad request fails alone (workers.engine isolates it) and the rest of the batch goes on.
Both are honoured only with a file named FAULT_INJECTION_FILE in the data dir: a production deployment
that merely inherits the variables never lets a client kill or fail workers.
Must not: be imported by anything but the worker loop and tests.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from shared.ir import Request
from shared.settings import Settings
from workers.scheduler import Sampled, StepPlan

log = logging.getLogger(__name__)
FAULT_INJECTION_FILE = "ENABLE_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """Raised by an injection point (never by real code)."""


@dataclass(frozen=True, slots=True)
class Faults:
    crash_on: str = ""
    fail_on: str = ""

    def fails_add(self, request: Request) -> bool:
        return bool(self.fail_on) and f"{self.fail_on}:add" in request.raw_body

    def fails_step(self, request: Request) -> bool:
        return bool(self.fail_on) and f"{self.fail_on}:step" in request.raw_body


def fault_injection(settings: Settings) -> Faults:
    """The faults to inject: none unless a test enabled them with the flag file in the data dir."""
    if not settings.crash_on and not settings.fail_on:
        return Faults()
    if os.path.exists(os.path.join(settings.data_dir, FAULT_INJECTION_FILE)):
        log.warning("fault injection is on: crash_on=%r fail_on=%r", settings.crash_on, settings.fail_on)
        return Faults(crash_on=settings.crash_on, fail_on=settings.fail_on)
    log.warning("MET_CRASH_ON / MET_FAIL_ON are set but fault injection is not enabled (no %s in %s): ignored", FAULT_INJECTION_FILE, settings.data_dir)
    return Faults()


class FaultyRunner:
    """Wraps a runner: `execute` raises while the plan holds a request `faults.fails_step` picks."""

    def __init__(self, runner: Any, faults: Faults) -> None:
        self._runner = runner
        self._faults = faults

    def execute(self, plan: StepPlan) -> list[Sampled]:
        members = [*plan.decode, *(c.seq for c in plan.prefill)]
        poisoned = [s.key for s in members if self._faults.fails_step(s.request)]
        if poisoned:
            raise InjectedFault(f"fault injection: the step fails while it runs {poisoned}")
        result: list[Sampled] = self._runner.execute(plan)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)
