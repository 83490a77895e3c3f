"""Prints, as JSON, what this interpreter's ``import deepspeed`` and the availability checks of transformers and
accelerate resolve to (run with and without ZEROENGINE_AS_DEEPSPEED)."""
import importlib
import importlib.metadata
import importlib.util
import json
import sys

out = {}
spec = importlib.util.find_spec("deepspeed")
out["spec_origin"] = None if spec is None else spec.origin
try:
    out["version"] = importlib.metadata.version("deepspeed")
except importlib.metadata.PackageNotFoundError:
    out["version"] = None
try:
    import deepspeed

    out["file"] = deepspeed.__file__
    out["dunder_version"] = deepspeed.__version__
except ImportError as error:
    out["file"] = None
    out["import_error"] = str(error)
if "--paths" in sys.argv:
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.comm import is_initialized
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.utils import logger

    import zeroengine
    from zeroengine.engine import Engine

    out["engine_is_zeroengine"] = DeepSpeedEngine is Engine and deepspeed.DeepSpeedEngine is Engine
    out["initialize"] = deepspeed.initialize.__module__
    out["zero_is_zeroengine"] = deepspeed.zero.Init is zeroengine.zero.Init and \
        deepspeed.zero.GatheredParameters is zeroengine.zero.GatheredParameters and \
        partition_parameters.GatheredParameters is zeroengine.zero.GatheredParameters
    out["schedules"] = VALID_LR_SCHEDULES
    out["logger"] = logger.name
    out["comm_initialized"] = is_initialized() and dist.is_initialized()
    out["accelerator"] = [get_accelerator().device_name(), get_accelerator().communication_backend_name()]
    out["cpu_adam"] = [c.__name__ for c in DeepSpeedCPUAdam.__mro__[:3]]
    out["optimizer_base"] = DeepSpeedOptimizer.__name__
    base = torch.arange(6.0)
    original = {"a": torch.arange(4.0), "view": base[1:3], "nested": [(torch.ones(2),)]}
    cloned = clone_tensors_for_torch_save(original)
    a = cloned["a"]
    out["clone"] = {
        "own_storage": a.untyped_storage().data_ptr() != original["a"].untyped_storage().data_ptr(),
        "equal": torch.equal(a, original["a"]) and torch.equal(cloned["view"], base[1:3]),
        "original_unchanged": bool(a.add_(1).ne(original["a"]).all()) and torch.equal(original["a"], torch.arange(4.0)),
        # DeepSpeed clones so that torch.save writes a view's own elements, not its whole base storage
        "view_trimmed": cloned["view"].untyped_storage().nbytes() == 2 * base.element_size(),
        "nested": torch.equal(cloned["nested"][0][0], torch.ones(2)) and
        cloned["nested"][0][0].data_ptr() != original["nested"][0][0].data_ptr(),
    }
    out["same_module_both_names"] = sys.modules["deepspeed.runtime.engine"] is \
        sys.modules["zeroengine.integrations.ds_compat.runtime.engine"]
    from accelerate.utils import compare_versions
    from accelerate.utils import is_deepspeed_available as accelerate_available
    from transformers.integrations.deepspeed import is_deepspeed_available as hf_available

    out["transformers_sees_it"] = hf_available()
    out["accelerate_sees_it"] = accelerate_available() and compare_versions("deepspeed", ">=", "0.9.3")
    try:
        import deepspeed.no_such_module  # noqa: F401
        out["missing_module"] = "imported"
    except ModuleNotFoundError as error:
        out["missing_module"] = str(error)
print(json.dumps(out))
