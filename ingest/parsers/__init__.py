"""Each protocol's body → the request IR, and the pure checks around it (fields, constraints, context, model names, error shapes). No I/O."""
