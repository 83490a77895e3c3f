"""``deepspeed.runtime.fp16.loss_scaler``: the loss-scaler classes DeepSpeed pickles into its checkpoints, as
zeroengine's stand-ins (plain attribute bags), so that a DeepSpeed file unpickles under the alias
(``torch.load(weights_only=False)``, as Lightning's zero_to_fp32 helper loads one). zeroengine's own loss
scaling is zeroengine.precision's."""
from zeroengine.checkpoint.deepspeed.pickles import DynamicLossScaler, LossScaler  # noqa: F401
