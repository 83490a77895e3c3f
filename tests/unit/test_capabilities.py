"""Features the schema accepts but this build cannot run are refused before training, not ignored."""
import warnings

import pytest

from zeroengine.capabilities import check_supported
from zeroengine.config import ConfigError, load_config


def _cfg(**extra):
    return load_config({"train_micro_batch_size_per_gpu": 1, **extra})


@pytest.mark.parametrize("extra,key", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param"),
])
def test_unimplemented_features_are_refused_with_their_key(extra, key):
    with pytest.raises(ConfigError) as err:
        check_supported(_cfg(**extra))
    assert err.value.key_path == key and "not implemented" in str(err.value)


def test_disabled_blocks_and_defaults_pass_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_supported(_cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "none"}},
                             monitor={"csv": {"enabled": False}}, activation_checkpointing={}))
        check_supported(_cfg(zero_optimization={"stage": 3}))


def test_activation_checkpointing_options_are_accepted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_supported(_cfg(activation_checkpointing={
            "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
            "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}))


def test_stage3_tuning_knobs_are_honoured_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_supported(_cfg(zero_optimization={
            "stage": 3, "stage3_prefetch_bucket_size": 1000, "stage3_max_live_parameters": 10**6,
            "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}))


def test_non_elementwise_optimizers_need_the_explicit_opt_in():
    import torch

    from zeroengine.zero.factory import check_shardable

    params = [torch.nn.Parameter(torch.zeros(4))]
    check_shardable(torch.optim.SGD(params, lr=0.1), allow_untested=False)
    with pytest.raises(ConfigError, match="LBFGS is not known to be elementwise") as err:
        check_shardable(torch.optim.LBFGS(params), allow_untested=False)
    assert err.value.key_path == "zero_allow_untested_optimizer"
    check_shardable(torch.optim.LBFGS(params), allow_untested=True)
