"""``deepspeed.utils``: the logger, the full-value helpers, ``set_z3_leaf_modules``, ``RepeatingLoader`` and the
sequence-parallel ``groups`` questions."""
from __future__ import annotations

from zeroengine.data import RepeatingLoader  # noqa: F401
from zeroengine.progress import get_logger
from zeroengine.zero import (  # noqa: F401
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

logger = get_logger()

from . import groups  # noqa: E402,F401 (deepspeed.utils.groups)


def set_z3_leaf_modules(model, leaf_module_classes):
    """DeepSpeed's ZeRO-3 leaf modules (fetch an MoE block's experts all at once). zeroengine's stage 3 gathers
    by module already and needs no leaf marking for correctness, so this checks the classes exist in the model
    and returns the matching modules, as DeepSpeed does, without changing how they are fetched."""
    names = {c if isinstance(c, str) else c.__name__ for c in leaf_module_classes}
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(f"set_z3_leaf_modules: no module of class {sorted(names)} in the model")
    return found
