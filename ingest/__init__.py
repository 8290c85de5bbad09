"""API nodes: parse each protocol's body into the IR, admit it, publish it to Redis, answer the client."""
