"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: zeroengine.sequence_parallel's objects (Ulysses attention,
the data adapter, and the tiled compute of DeepSpeed 0.19)."""
from zeroengine.sequence_parallel import (  # noqa: F401
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    sequence_tiled_compute,
)
