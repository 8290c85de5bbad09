"""API nodes: parse each protocol's body into the IR, admit it, publish it to Redis, answer the client.

`parsers/` (each protocol's body → IR, pure), `http/` (the app, routes, admission, resume, metrics and
the protocol rows), `batches/` (files and batch jobs), `dumps/` (the `--dump-dir` writer and reader).
"""
