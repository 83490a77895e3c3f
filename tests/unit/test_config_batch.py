"""The batch-size triangle, exhaustively: every key given, missing or "auto"."""
import itertools

import pytest

from zeroengine.config import ConfigError, load_config
from zeroengine.config.batch import resolve_batch

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
WORLD = 2
VALUES = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}


def expected(given: set, any_auto: bool):
    """What DeepSpeed's rules (plus the "auto" fallback) give, written out case by case."""
    tbs, micro, gas = (VALUES[k] if k in given else None for k in KEYS)
    if len(given) >= 2:
        return 16, 2, 4                  # the third follows from the other two
    if given == {"train_batch_size"}:
        return 16, 16 // WORLD, 1        # one accumulation step
    if given == {"train_micro_batch_size_per_gpu"}:
        return 2 * WORLD, 2, 1
    if any_auto:                         # too little given, but "auto": micro batch 1
        gas = gas or 1
        return gas * WORLD, 1, gas
    return None                          # an error


@pytest.mark.parametrize("states", list(itertools.product(("given", "missing", "auto"), repeat=3)),
                         ids=lambda s: "-".join(s))
def test_every_combination_of_given_missing_and_auto(states):
    config = {}
    for key, state in zip(KEYS, states):
        if state == "given":
            config[key] = VALUES[key]
        elif state == "auto":
            config[key] = "auto"
    given = {k for k, s in zip(KEYS, states) if s == "given"}
    want = expected(given, "auto" in states)
    if want is None:
        with pytest.raises(ConfigError) as info:
            load_config(config, world_size=WORLD)
        assert info.value.key_path == "train_batch_size"
        assert "set train_batch_size or train_micro_batch_size_per_gpu" in str(info.value)
        return
    cfg = load_config(config, world_size=WORLD)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == want
    assert all(type(v) is int for v in got)
    assert got[0] == got[1] * got[2] * WORLD


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro, gas", [(1, 1), (2, 3), (4, 8)])
def test_any_two_determine_the_third(world, micro, gas):
    tbs = micro * gas * world
    assert resolve_batch(tbs, micro, None, world) == (tbs, micro, gas)
    assert resolve_batch(tbs, None, gas, world) == (tbs, micro, gas)
    assert resolve_batch(None, micro, gas, world) == (tbs, micro, gas)
    assert resolve_batch(tbs, micro, gas, world) == (tbs, micro, gas)


@pytest.mark.parametrize("tbs, micro, gas, world", [
    (32, 4, 2, 2),     # 4 * 2 * 2 = 16
    (16, 4, 4, 2),
    (8, 8, 1, 2),
])
def test_inconsistent_three_values_name_all_of_them(tbs, micro, gas, world):
    with pytest.raises(ConfigError) as info:
        resolve_batch(tbs, micro, gas, world)
    message = str(info.value)
    for number in (f"({tbs})", f"({micro})", f"({gas})", f"world size ({world})"):
        assert number in message


@pytest.mark.parametrize("tbs, micro, gas, world, derived", [
    (10, 4, None, 1, "gradient_accumulation_steps"),
    (12, 8, None, 1, "gradient_accumulation_steps"),   # would round to 1
    (4, 8, None, 1, "gradient_accumulation_steps"),    # would round to 0
    (12, None, 5, 1, "train_micro_batch_size_per_gpu"),
    (12, None, 2, 4, "train_micro_batch_size_per_gpu"),
    (9, None, None, 2, "train_micro_batch_size_per_gpu"),
])
def test_values_that_do_not_divide_are_errors_not_rounded(tbs, micro, gas, world, derived):
    with pytest.raises(ConfigError) as info:
        resolve_batch(tbs, micro, gas, world)
    assert "not divisible" in str(info.value) and derived in str(info.value)


def test_whole_floats_load_as_ints():
    cfg = load_config({"train_batch_size": 2.56e2, "train_micro_batch_size_per_gpu": 8.0}, world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (256, 8, 8)
    assert type(cfg.train_batch_size) is int


def test_reloading_a_config_for_another_world_rederives_the_batch():
    cfg = load_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert cfg.gradient_accumulation_steps == 8
    bigger = load_config(cfg, world_size=8)
    assert (bigger.train_batch_size, bigger.train_micro_batch_size_per_gpu, bigger.gradient_accumulation_steps) \
        == (64, 4, 2)
    assert cfg.gradient_accumulation_steps == 8          # the original is untouched
    with pytest.raises(ConfigError, match="not divisible"):
        load_config(cfg, world_size=32)
