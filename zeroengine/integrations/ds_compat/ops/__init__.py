"""``deepspeed.ops``: the optimizers integrations import (``ops.adam``) and ``ops.op_builder.AsyncIOBuilder``."""
from . import adam, op_builder  # noqa: F401
