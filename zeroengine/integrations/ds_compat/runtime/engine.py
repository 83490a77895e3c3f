"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is zeroengine's :class:`~zeroengine.engine.Engine`."""
from zeroengine.engine import Engine as DeepSpeedEngine  # noqa: F401
