"""``deepspeed.launcher``: only what ``accelerate launch`` imports (``runner.DEEPSPEED_ENVIRONMENT_NAME``)."""
from . import runner  # noqa: F401
