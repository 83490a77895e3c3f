"""``deepspeed.ops``: the optimizers integrations import (``ops.adam``)."""
from . import adam  # noqa: F401
