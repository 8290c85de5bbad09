"""The names a client may ask for: `--served-model-name A,B,…`, `--model-alias PATTERN=NAME`, and
`--accept-any-model` (pure; no I/O).

A request's `model` is served when it is one of the served names, or matches an alias (an exact name or
an fnmatch pattern such as `claude-*`, which is what coding agents send: Claude Code asks for
`claude-opus-…` and `claude-haiku-…`, Codex for `gpt-…`); otherwise it is a 404 in the protocol's own
shape naming `model`, as the hosted APIs answer an unknown model, unless `--accept-any-model`
(every name served by this one model, as before that flag existed). The response echoes the name the
client sent. `/v1/models` lists the served names, then each alias with its target as `parent`.
Must not: know protocols (the app renders the error in the caller's shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from shared.errors import ApiError


@dataclass(frozen=True, slots=True)
class ModelNames:
    served: tuple[str, ...]  # the first is the model's own name
    aliases: tuple[tuple[str, str], ...] = ()  # (pattern, served name)
    accept_any: bool = False

    @classmethod
    def parse(cls, default: str, served: str | None, aliases: str, *, accept_any: bool) -> ModelNames:
        names = tuple(n.strip() for n in (served or "").split(",") if n.strip()) or (default,)
        pairs = []
        for spec in (a.strip() for a in aliases.split(",") if a.strip()):
            pattern, sep, target = spec.partition("=")
            pattern, target = pattern.strip(), target.strip() or names[0]
            if not sep or not pattern:
                raise ValueError(f"--model-alias {spec!r}: expected PATTERN=NAME (e.g. 'claude-*={names[0]}')")
            if target not in names:
                raise ValueError(f"--model-alias {spec!r}: {target!r} is not a served model name ({', '.join(names)})")
            pairs.append((pattern, target))
        return cls(names, tuple(pairs), accept_any)

    @property
    def main(self) -> str:
        return self.served[0]

    def resolve(self, name: str, *, listed: bool = False) -> str | None:
        """The served name `name` is answered by, or None when it is unknown. `listed`: only a served
        name or an alias counts (`--accept-any-model` serves any name but lists no more models)."""
        if name in self.served:
            return name
        target = next((t for pattern, t in self.aliases if fnmatchcase(name, pattern)), None)
        if target is not None:
            return target
        return self.main if self.accept_any and not listed else None

    def check(self, name: str, param: str = "model", *, listed: bool = False) -> str:
        """`resolve`, or a 404 naming the parameter."""
        target = self.resolve(name, listed=listed)
        if target is None:
            hint = f" This server serves {', '.join(repr(n) for n in self.served)}"
            hint += f" and the aliases {', '.join(p for p, _ in self.aliases)}." if self.aliases else "."
            raise ApiError(f"The model '{name}' does not exist.{hint}", status=404, param=param, kind="not_found", code="model_not_found")
        return target

    def cards(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        """/v1/models entries: each served name with `base`'s fields, then each alias."""
        return [{**base, "id": n} for n in self.served] + [{**base, "id": p, "parent": t} for p, t in self.aliases]
