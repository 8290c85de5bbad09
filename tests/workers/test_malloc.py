"""`workers.main.keep_freed_memory`: a step's large temporaries reuse freed memory instead of faulting
fresh pages in again (the page faults are counted, in a fresh interpreter each way)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = """
import resource, sys, torch
sys.path.insert(0, {root!r})
if {keep}:
    from workers.main import keep_freed_memory
    assert keep_freed_memory()
def step():  # four 12 MiB temporaries live at once, as a decode step's gathered keys and values
    temps = [torch.empty(3 * 2**20, dtype=torch.float32).fill_(1.0) for _ in range(4)]
    return sum(float(t[0]) for t in temps)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS.format(root=str(ROOT), keep=keep)], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_after_keep_freed_memory_repeated_large_temporaries_stop_faulting_in_fresh_pages() -> None:
    default, kept = page_faults(False), page_faults(True)
    pages_per_step = 4 * 12 * 2**20 // 4096
    assert default > 20 * pages_per_step // 16, default  # glibc's default: part of every step's memory comes back from the kernel
    assert kept < default // 4, (kept, default)
