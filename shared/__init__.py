"""Provider-neutral core shared by every role: the request IR, stream deltas, codec, key names, settings.

Nothing here imports redis, blacksheep or torch; everything is pure data and pure functions.
"""
