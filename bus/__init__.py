"""The Redis side every role shares: how a client is made (one Redis or a Redis Cluster)."""
