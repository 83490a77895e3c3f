"""Stages 1-3 step flat slices of each parameter: only elementwise optimizers give the unsharded result."""
import pytest
import torch

from zeroengine.config import ConfigError
from zeroengine.zero.factory import check_shardable


def test_non_elementwise_optimizers_need_the_explicit_opt_in():
    params = [torch.nn.Parameter(torch.zeros(4))]
    check_shardable(torch.optim.SGD(params, lr=0.1), allow_untested=False)
    with pytest.raises(ConfigError, match="LBFGS is not known to be elementwise") as err:
        check_shardable(torch.optim.LBFGS(params), allow_untested=False)
    assert err.value.key_path == "zero_allow_untested_optimizer"
    check_shardable(torch.optim.LBFGS(params), allow_untested=True)
