"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: zeroengine's sequence-parallel state module itself
(the mpu ``register_with_transformers`` returns is that module, so both names are one object)."""
import sys

from zeroengine.sequence_parallel import parallel_state

sys.modules[__name__] = parallel_state
