"""Model files and prompt rendering, shared by ingest (tokenizer only) and workers (weights too)."""
