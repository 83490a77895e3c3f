"""client_state: what save_checkpoint accepts must load back with torch.load(weights_only=True)."""
import enum
import io
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from zeroengine.checkpoint import CheckpointError
from zeroengine.checkpoint.state import check_plain


def loads_back(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_plain_values_are_accepted_and_load_back():
    value = {"step": 3, "loss": 1.5, "name": "run", "none": None, "flag": True, "shape": torch.Size([2]),
             "dtype": torch.float16, "t": torch.ones(2), "nested": [1, (2.0, "x")], "od": OrderedDict(a=1)}
    assert check_plain(value) is value
    back = loads_back(value)
    assert back["nested"] == [1, (2.0, "x")] and torch.equal(back["t"], value["t"])


class Mode(enum.IntEnum):
    TRAIN = 1


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize("value, kind, plain", [
    (defaultdict(int, a=1), "collections.defaultdict", "dict"),
    (Point(1, 2), "Point", "tuple"),
    (Mode.TRAIN, "Mode", "int"),
])
def test_subclasses_of_plain_types_are_refused_at_save_time(value, kind, plain):
    with pytest.raises(Exception):
        loads_back({"v": value})  # what the load would have said, long after the save
    with pytest.raises(CheckpointError, match=rf"client_state\['v'\] is a .*{kind}.*store {plain}\(value\)"):
        check_plain({"v": value})


def test_numpy_scalars_are_refused_with_the_conversion_to_make():
    np = pytest.importorskip("numpy")
    with pytest.raises(CheckpointError, match=r"client_state\['mean'\] is a numpy.float64.*store float\(value\)"):
        check_plain({"mean": np.mean([1.0, 2.0])})
