import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The example GPT is the realistic model the tests train.
sys.path.insert(0, os.path.join(REPO, "examples", "gpt"))
sys.path.insert(0, os.path.join(REPO, "tests"))


def pytest_sessionstart(session):
    """Compile the repository's Python files to bytecode (``__pycache__``, git-ignored) before any test starts a
    process. An environment with PYTHONDONTWRITEBYTECODE=1 (as this machine's is) writes no bytecode on import, so
    every process the suite starts - hundreds of ranks, launched scripts and forked workers, which import
    zeroengine's modules, the test modules their functions live in and the tests' scripts - would compile those
    sources again: ~0.5 s of CPU per process. Bytecode is still read where present, and checked against its
    source's timestamp, so an edited file is compiled afresh. Nothing is compiled where the tree is read-only."""
    import compileall

    for folder in ("zeroengine", "tests", "benchmarks", "examples"):
        try:
            compileall.compile_dir(os.path.join(REPO, folder), quiet=2)
        except OSError:
            pass


# The order files start in (scripts/test.sh's two workers take whole files, in collection order): the longest first,
# so that the last minutes are filled with short unit-test files rather than one worker running a long integration
# module while the other waits. Stable: a file's tests stay together and in their order.
_FIRST = ("integrations", "distributed", "migration")


def _start_rank(item) -> int:
    folder = os.path.relpath(str(item.path), os.path.join(REPO, "tests")).split(os.sep)[0]
    return _FIRST.index(folder) if folder in _FIRST else len(_FIRST)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=_start_rank)
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
