"""Worker processes: claim requests from the consumer group, run them batched, append deltas.

Three parts (HOUSE_STYLE): `scheduler` decides (torch-free), `runner` executes (all torch), `loop`
does the Redis I/O; `engine` ties scheduler, runner and per-sequence text state together.
"""

from workers.kernels import pin_environment

pin_environment()  # MKL's reproducible mode, before MKL's first call (workers.kernels)
