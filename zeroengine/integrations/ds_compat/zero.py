"""``deepspeed.zero``: zeroengine's stage-3 helpers under DeepSpeed's names."""
from zeroengine.zero import (  # noqa: F401
    GatheredParameters,
    Init,
    register_external_parameter,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    unregister_external_parameter,
)
from zeroengine.zero.param_guard import PartitionedParameterError  # noqa: F401
