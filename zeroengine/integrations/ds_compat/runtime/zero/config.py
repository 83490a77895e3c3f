"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum``, which DeepSpeed pickles into its checkpoints (zeroengine's
stand-in: an int enum of the same members), so that a DeepSpeed file unpickles under the alias."""
from zeroengine.checkpoint.deepspeed.pickles import ZeroStageEnum  # noqa: F401
