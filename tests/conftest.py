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
