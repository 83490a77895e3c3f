"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: zeroengine.sequence_parallel's objects."""
from zeroengine.sequence_parallel import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter  # noqa: F401
