"""Loading is strict both ways, as torch's load_state_dict: every value of the model comes from the
checkpoint (also when a parameter was frozen when saved and is trained now, or the reverse), and the
checkpoint has nothing the model lacks."""
import pytest
import torch
from parity import make_model
from test_checkpoint_reshard import config, full_state, train

import zeroengine
from zeroengine.testing import DistributedTestError, run_distributed

FROZEN = "blocks.0.attn.qkv.weight"


def build(world, stage, frozen, seed, extra_buffer=False):
    model = make_model(seed=seed)
    if frozen:
        model.get_parameter(frozen).requires_grad_(False)
    if extra_buffer:
        model.register_buffer("calls", torch.zeros(3))
    engine, _, _, _ = zeroengine.initialize(model=model, config=config(world, stage))
    return engine


def save(rank, world, stage, save_dir, frozen):
    engine = build(world, stage, frozen, seed=0)
    train(engine, rank, world, 0, 2)
    engine.save_checkpoint(save_dir, tag="t")
    return full_state(engine)


def load(rank, world, stage, load_dir, frozen, extra_buffer=False):
    engine = build(world, stage, frozen, seed=7, extra_buffer=extra_buffer)  # other initial values than saved
    engine.load_checkpoint(load_dir, tag="t")
    state = full_state(engine)
    train(engine, rank, world, 2, 1)  # the optimizer's fp32 copy was loaded too: a step keeps the values near
    return state, full_state(engine)


@pytest.mark.parametrize("saved_frozen, loaded_frozen", [(None, FROZEN), (FROZEN, None)])
@pytest.mark.parametrize("world, stage", [(1, 0), (2, 3)])
def test_a_parameter_frozen_on_one_side_only_still_gets_its_saved_values(tmp_path, world, stage, saved_frozen,
                                                                         loaded_frozen):
    save_dir = str(tmp_path / "run")
    saved = run_distributed(save, world, stage, save_dir, saved_frozen)[0]
    loaded, after = run_distributed(load, world, stage, save_dir, loaded_frozen)[0]
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    # a step later the weight moved a little from the saved one (lr 1e-2), not back to a fresh init
    assert (after[FROZEN] - saved[FROZEN]).abs().max() < 0.05


def test_a_buffer_the_checkpoint_lacks_is_an_error_naming_it(tmp_path):
    save_dir = str(tmp_path / "run")
    run_distributed(save, 1, 0, save_dir, None)
    with pytest.raises(DistributedTestError, match=r"has no values for \['calls'\]"):
        run_distributed(load, 1, 0, save_dir, None, True)


def load_with_one_block_less(rank, world, load_dir):
    model = make_model()
    del model.blocks[-1]  # its stored parameters are claimed by no rank
    engine, _, _, _ = zeroengine.initialize(model=model, config=config(world, 2))
    engine.load_checkpoint(load_dir, tag="t")


def test_stored_parameters_the_model_lacks_are_an_error(tmp_path):
    save_dir = str(tmp_path / "run")
    run_distributed(save, 2, 2, save_dir, None)
    with pytest.raises(DistributedTestError, match=r"has parameter\(s\) \['blocks.1.attn.proj.bias'.* that this model does not have"):
        run_distributed(load_with_one_block_less, 2, save_dir)


def grouped(world, stage, reverse, seed):
    model = make_model(seed=seed)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    engine, _, _, _ = zeroengine.initialize(model=model, model_parameters=groups[::-1] if reverse else groups,
                                            config=config(world, stage))
    return engine


def save_grouped(rank, world, stage, save_dir):
    engine = grouped(world, stage, reverse=False, seed=0)
    train(engine, rank, world, 0, 1)
    for g in engine.optimizer.param_groups:
        g["weight_decay"] *= 3  # moved during training: only the checkpoint knows these values
    engine.save_checkpoint(save_dir, tag="t")


def load_grouped_in_the_other_order(rank, world, stage, load_dir):
    engine = grouped(world, stage, reverse=True, seed=7)
    engine.load_checkpoint(load_dir, tag="t")
    return [g["weight_decay"] for g in engine.optimizer.param_groups]


@pytest.mark.parametrize("world, stage", [(1, 0), (2, 2)])
def test_param_group_settings_follow_their_parameters_not_the_group_order(tmp_path, world, stage):
    save_dir = str(tmp_path / "run")
    run_distributed(save_grouped, world, stage, save_dir)
    decays = run_distributed(load_grouped_in_the_other_order, world, stage, save_dir)[0]
    assert decays == pytest.approx([0.0, 0.3])  # the no-decay group is first now; it kept its 0


def _block0_groups(model):
    first = [p for n, p in model.named_parameters() if n.startswith("blocks.0.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.0.")]
    return first, rest


def save_two_groups(rank, world, stage, save_dir):
    model = make_model(seed=0)
    first, rest = _block0_groups(model)
    engine, _, _, _ = zeroengine.initialize(model=model, model_parameters=[
        {"params": first, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.2}], config=config(world, stage))
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag="t")
    return full_state(engine)


def load_with_a_group_frozen(rank, world, stage, load_dir):
    model = make_model(seed=7)
    first, rest = _block0_groups(model)
    for p in first:
        p.requires_grad_(False)  # the whole first group is frozen now: one group left
    engine, _, _, _ = zeroengine.initialize(model=model, model_parameters=[{"params": rest, "weight_decay": 0.0}],
                                            config=config(world, stage))
    engine.load_checkpoint(load_dir, tag="t")
    return full_state(engine), [g["weight_decay"] for g in engine.optimizer.param_groups]


@pytest.mark.parametrize("world, stage", [(1, 0), (2, 2)])
def test_a_checkpoint_loads_when_a_saved_param_group_is_frozen_now(tmp_path, world, stage):
    save_dir = str(tmp_path / "run")
    saved = run_distributed(save_two_groups, world, stage, save_dir)[0]
    state, decays = run_distributed(load_with_a_group_frozen, world, stage, save_dir)[0]
    assert decays == pytest.approx([0.2])  # the remaining group got its own saved settings
    for name, value in saved.items():  # frozen block 0 included
        assert torch.equal(state[name], value), name


def save_in_one_group(rank, world, stage, save_dir):
    engine = build(world, stage, None, seed=0)  # one param group, from the config
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(save_dir, tag="t")
    return full_state(engine)


def load_into_decay_groups(rank, world, stage, load_dir, **flags):
    engine = grouped(world, stage, reverse=False, seed=7)
    engine.load_checkpoint(load_dir, tag="t", **flags)
    return full_state(engine), len(engine.optimizer.state) == 0


@pytest.mark.parametrize("flags", [{"load_module_only": True}, {"load_optimizer_states": False}])
def test_weights_load_into_new_param_groups_when_the_optimizer_state_is_not_loaded(tmp_path, flags):
    # a warm start with decay / no-decay groups from a one-group checkpoint (DeepSpeed never looks at
    # the optimizer here); loading the optimizer state too is refused, naming two parameters that disagree
    save_dir = str(tmp_path / "run")
    saved = run_distributed(save_in_one_group, 1, 0, save_dir)[0]
    state, fresh_optimizer = run_distributed(load_into_decay_groups, 1, 0, save_dir, **flags)[0]
    assert fresh_optimizer
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
    with pytest.raises(DistributedTestError, match=r"param groups differ from checkpoint .*parameter '.*' was in "
                       r"saved group 0 and is in group 1 now, but '.*' was in saved group 0 and is in group 0 "
                       r"now.*load_optimizer_states=False"):
        run_distributed(load_into_decay_groups, 1, 0, save_dir)


def load_with_sgd(rank, world, stage, load_dir, **flags):
    model = make_model(seed=7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = config(world, stage)
    del cfg["optimizer"], cfg["scheduler"]
    engine, _, _, _ = zeroengine.initialize(model=model, optimizer=optimizer, config=cfg)
    engine.load_checkpoint(load_dir, tag="t", **flags)
    train(engine, rank, world, 1, 1)  # a step runs with the fresh momentum state
    return full_state(engine)


def test_optimizer_state_of_another_optimizer_type_is_refused(tmp_path):
    save_dir = str(tmp_path / "run")
    run_distributed(save_in_one_group, 2, 2, save_dir)  # AdamW
    with pytest.raises(DistributedTestError, match=r"holds AdamW optimizer state and this engine's optimizer is "
                                                   r"SGD: pass load_optimizer_states=False"):
        run_distributed(load_with_sgd, 2, 2, save_dir)
    run_distributed(load_with_sgd, 2, 2, save_dir, load_optimizer_states=False)


def save_with_numpy_lr(rank, world, stage, save_dir):
    np = pytest.importorskip("numpy")
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=np.float64(0.02) / 2)  # a numpy scalar lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: np.float32(0.5) ** step)
    cfg = config(world, stage)
    del cfg["optimizer"], cfg["scheduler"]
    engine, _, _, _ = zeroengine.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    train(engine, rank, world, 0, 2)
    engine.save_checkpoint(save_dir, tag="t")
    return full_state(engine), engine.get_lr()


def load_with_numpy_lr(rank, world, stage, load_dir):
    model = make_model(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    cfg = config(world, stage)
    del cfg["optimizer"], cfg["scheduler"]
    engine, _, _, _ = zeroengine.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    engine.load_checkpoint(load_dir, tag="t")
    return full_state(engine), engine.get_lr(), type(engine.optimizer.param_groups[0]["lr"])


def test_numpy_scalars_in_the_optimizer_and_scheduler_state_are_saved_as_numbers(tmp_path):
    # the checkpoint loads with weights_only=True, which refuses numpy scalars: it was written, then unloadable
    save_dir = str(tmp_path / "run")
    saved, saved_lr = run_distributed(save_with_numpy_lr, 1, 2, save_dir)[0]
    state, lr, lr_type = run_distributed(load_with_numpy_lr, 1, 2, save_dir)[0]
    assert lr == pytest.approx(saved_lr) and lr_type is float
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
