"""``deepspeed.runtime.sequence_parallel``: Ulysses sequence parallelism (zeroengine.sequence_parallel)."""
from . import parallel_state_sp, ulysses_sp  # noqa: F401
