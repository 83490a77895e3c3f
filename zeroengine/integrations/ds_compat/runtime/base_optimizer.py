"""``deepspeed.runtime.base_optimizer``: ``DeepSpeedOptimizer`` is the class of every ``engine.optimizer``
(Lightning's Fabric checks ``isinstance(optimizer, DeepSpeedOptimizer)``)."""
from zeroengine.zero.optimizer import ZeroOptimizer as DeepSpeedOptimizer  # noqa: F401
from zeroengine.zero.optimizer import ZeroOptimizer as ZeROOptimizer  # noqa: F401
