"""The API node's HTTP side: the app and its routes, auth and limits, admission and publishing to Redis, resume, metrics, the protocol rows (surfaces)."""
