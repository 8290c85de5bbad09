"""Log setup for every `met` process: human lines (`--log-format plain`, the default) or one JSON object
a line (`--log-format json`) for log shippers.

Hand-rolled on purpose: a JSON formatter is a dozen lines over the standard `logging` and orjson
(already a dependency), where a library (python-json-logger, structlog) would be a new dependency
for the same few lines. A record's `fields` (the access log's, ingest/http/request_log.py) become
top-level JSON keys.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import orjson

PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("plain", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure(log_format: str) -> None:
    """Install the root handler (stderr) in the chosen format; `plain` for anything but `json`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(PLAIN))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
