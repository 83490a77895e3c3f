"""``deepspeed.runtime.lr_schedules``: the schedule names zeroengine builds from a config's ``scheduler``.

transformers reads ``VALID_LR_SCHEDULES`` to decide whether a config's scheduler type is DeepSpeed's."""
from zeroengine.optim.schedulers import SCHEDULERS

VALID_LR_SCHEDULES = sorted(SCHEDULERS)
