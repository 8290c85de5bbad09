"""The design's import layers as data, and a check of a source tree against them (tests/test_layers.py).

Roles meet only in Redis (DESIGN.md): an API node never imports a worker's code and a worker never
imports the API's; the encoders are pure (only their one wire module reads Redis); `shared` and `bus`
sit under everything; the API node, the encoders and the shared code stay torch-free; the API node's
protocol parsers (ingest/parsers) do no I/O. Every import
counts, at module level or inside a function, since a lazy import crosses a boundary all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("shared", "bus", "encoders", "models", "ingest", "workers", "cli")

# package -> the project packages it may import (besides itself)
MAY_IMPORT: dict[str, frozenset[str]] = {
    "shared": frozenset(),
    "bus": frozenset({"shared"}),
    "encoders": frozenset({"shared", "bus"}),
    "models": frozenset({"shared"}),
    "ingest": frozenset({"shared", "bus", "encoders", "models"}),
    "workers": frozenset({"shared", "bus", "models"}),
    "cli": frozenset(PACKAGES),
}
# module -> third-party packages it must never import
NEVER: dict[str, frozenset[str]] = {
    "shared": frozenset({"torch", "transformers", "blacksheep"}),
    "bus": frozenset({"torch", "transformers", "blacksheep"}),
    "encoders": frozenset({"torch", "transformers", "blacksheep", "redis"}),
    "ingest": frozenset({"torch"}),
}
# folder -> third-party packages nothing under it may import: the protocol parsers are pure (body -> IR)
NEVER_UNDER: dict[str, frozenset[str]] = {"ingest/parsers": frozenset({"redis", "blacksheep", "httpx"})}
# the one module of a package allowed past its package's rule: the encoders' wire I/O (Redis tails, HTTP streaming)
EXCEPTIONS: dict[str, frozenset[str]] = {"encoders/wire.py": frozenset({"redis", "blacksheep"})}


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in one file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def violations(root: Path) -> list[str]:
    """Every import under `root` that breaks a rule, as `path:line: package imports X`."""
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            allowed_third = EXCEPTIONS.get(relative, frozenset())
            for line, top in imported(path):
                if (top in PACKAGES and top != package and top not in MAY_IMPORT[package]) or top in NEVER.get(package, frozenset()) - allowed_third:
                    found.append(f"{relative}:{line}: {package} imports {top}")
                for folder, never in NEVER_UNDER.items():
                    if relative.startswith(folder + "/") and top in never:
                        found.append(f"{relative}:{line}: {folder} imports {top}")
    return found
