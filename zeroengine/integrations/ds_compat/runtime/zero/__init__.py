"""``deepspeed.runtime.zero``: zeroengine's stage-3 helpers (the same objects as ``deepspeed.zero``)."""
from ...zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter  # noqa: F401
from . import partition_parameters  # noqa: F401
