"""Pure state machines turning one request's delta stream into a protocol's SSE frames or final JSON.

Each protocol module exposes a stream encoder (`feed(delta) -> list[Frame]`, idempotent `finish()`)
and an accumulator for the non-streaming body, both built from the request IR alone. Only
`encoders.wire` does I/O.
"""
