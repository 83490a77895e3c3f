"""``deepspeed.utils.tensor_fragment``: ``fragment_address``, which DeepSpeed pickles into its checkpoints
(zeroengine's stand-in: a dataclass of numel and start), so that a DeepSpeed file unpickles under the alias."""
from zeroengine.checkpoint.deepspeed.pickles import fragment_address  # noqa: F401
