import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The example GPT is the realistic model the tests train.
sys.path.insert(0, os.path.join(REPO, "examples", "gpt"))
sys.path.insert(0, os.path.join(REPO, "tests"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_activation_checkpointing_settings():
    """zeroengine.checkpointing's settings and model-parallel RNG tracker are process-global, as DeepSpeed's
    are: no test inherits another's (a tracker state left behind adds a saved RNG state to every checkpoint)."""
    from zeroengine import checkpointing

    checkpointing.reset()
    checkpointing.get_cuda_rng_tracker().reset()
    yield
