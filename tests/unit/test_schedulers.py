"""LR schedules: every value checked against formulas written out independently here."""
import math

import pytest
import torch

from zeroengine.optim.schedulers import (
    SCHEDULERS,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

STEPS = 30


def make_optimizer(kind="sgd", lrs=(0.1, 0.01)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.5)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lrs[0])
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=lrs[0])
    raise AssertionError(kind)


def trajectory(scheduler, steps=STEPS, key="lr"):
    """Values in the optimizer after construction, then after each step()."""
    def read():
        return [g[key] for g in scheduler.optimizer.param_groups]
    values = [read()]
    for _ in range(steps):
        scheduler.step()
        values.append(read())
    return values


def assert_close(actual, expected):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a == pytest.approx(e, rel=1e-12, abs=1e-15), f"iteration {i - 1}: {a} != {e}"


# ---- independent reference formulas (iteration i = last_batch_iteration) ----

def ref_warmup(i, num_steps, kind):
    n = max(2, num_steps)
    if i < 0:
        return 0.0
    if i >= n:
        return 1.0
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


def ref_warmup_lr(i, lo, hi, n, kind):
    return lo + (hi - lo) * ref_warmup(i, n, kind)


def ref_warmup_decay_lr(i, lo, hi, n, total, kind):
    if i < max(2, n):
        return ref_warmup_lr(i, lo, hi, n, kind)
    n = max(2, n)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - n))


def ref_cosine_lr(i, base, n, total, wmin, cmin, kind):
    if i < 0:
        return 0.0
    if i < max(2, n):
        return base * (wmin + (1 - wmin) * ref_warmup(i, n, kind))
    n = max(2, n)
    p = min(1.0, (i - n + 1) / max(1, total - n))
    return base * max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * p)))


def ref_one_cycle_scale(i, first, second, stairs1=0, stairs2=None):
    stairs2 = stairs1 if stairs2 is None else stairs2
    total = first + second
    pos = (i + 1) % total
    if pos <= first:
        frac, stairs, span = pos / first, stairs1, first
    else:
        frac, stairs, span = (total - pos) / second, stairs2, second
    if stairs:
        covered = pos if pos <= first else total - pos
        frac = math.floor(covered * stairs / span) / stairs
    return frac


def ref_one_cycle(i, c):
    total = c["first"] + c["second"]
    if i < 0:
        return c["min_lr"], c["min_mom"]
    if i < total:
        s = ref_one_cycle_scale(i, c["first"], c["second"], c.get("stairs1", 0), c.get("stairs2"))
        return c["min_lr"] + (c["max_lr"] - c["min_lr"]) * s, c["max_mom"] - (c["max_mom"] - c["min_mom"]) * s
    d = (i - total + 1) / c["decay_step"] if c["decay_step"] else 0.0
    lr = c["min_lr"] / (1 + c["lr_rate"] * d) if c["decay_step"] and c["lr_rate"] else c["min_lr"]
    mom = c["max_mom"] * (1 + c["mom_rate"] * d) if c["decay_step"] and c["mom_rate"] else c["max_mom"]
    return lr, mom


# ---- WarmupLR / WarmupDecayLR ----

@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_per_group(kind):
    opt = make_optimizer()
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.001], warmup_max_lr=[0.5, 0.05], warmup_num_steps=10,
                     warmup_type=kind)
    expected = [[ref_warmup_lr(i, lo, hi, 10, kind) for lo, hi in ((0.0, 0.5), (0.001, 0.05))]
                for i in range(-1, STEPS)]
    assert_close(trajectory(sched), expected)
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]
    assert sched.get_lr() == sched.get_last_lr()


def test_warmup_lr_defaults_and_tiny_warmup():
    opt = make_optimizer(lrs=(0.1, 0.01))
    sched = WarmupLR(opt)  # DeepSpeed 0.19.8: warms up to each group's own lr
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    sched.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr * math.log(2) / math.log(1000)
                                                                 for lr in (0.1, 0.01)])
    assert WarmupDecayLR(make_optimizer(), 2000).max_lrs == [0.001, 0.001]
    # warmup_num_steps=1 is clamped to 2 (log(1) would divide by zero)
    sched = WarmupLR(make_optimizer(), warmup_max_lr=1.0, warmup_num_steps=1)
    assert_close([v[0] for v in trajectory(sched, 4)], [ref_warmup_lr(i, 0, 1, 1, "log") for i in range(-1, 4)])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_zero_warmup_steps_means_no_warmup(kind):
    # HF's "auto" resolves warmup_num_steps to 0; clamping it to 2 (older DeepSpeed) held the lr at
    # warmup_min_lr for the first two optimizer steps
    sched = WarmupLR(make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=0.5, warmup_num_steps=0, warmup_type=kind)
    assert [v[0] for v in trajectory(sched, 4)] == [0.5] * 5
    sched = WarmupDecayLR(make_optimizer(), total_num_steps=4, warmup_max_lr=0.5, warmup_num_steps=0,
                          warmup_type=kind)
    assert_close([v[0] for v in trajectory(sched, 4)], [0.5, 0.5, 0.375, 0.25, 0.125])
    sched = WarmupLR(make_optimizer(), warmup_max_lr=0.4, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2  # 1 is clamped to 2, as DeepSpeed does
    assert_close([v[0] for v in trajectory(sched, 3)], [0.0, 0.0, 0.2, 0.4])
    sched = WarmupCosineLR(make_optimizer(lrs=(0.5, 0.5)), total_num_steps=4, warmup_num_steps=0,
                           cos_min_ratio=0.0, warmup_type=kind)
    lrs = [v[0] for v in trajectory(sched, 4)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)) / 2)


def test_warmup_lr_max_none_uses_group_lrs():
    opt = make_optimizer(lrs=(0.2, 0.02))
    sched = WarmupLR(opt, warmup_max_lr=None, warmup_num_steps=4, warmup_type="linear")
    values = trajectory(sched, 6)
    assert values[-1] == [0.2, 0.02]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    opt = make_optimizer()
    sched = WarmupDecayLR(opt, total_num_steps=25, warmup_min_lr=0.01, warmup_max_lr=[0.5, 0.1],
                          warmup_num_steps=8, warmup_type=kind)
    expected = [[ref_warmup_decay_lr(i, 0.01, hi, 8, 25, kind) for hi in (0.5, 0.1)] for i in range(-1, STEPS)]
    assert_close(trajectory(sched), expected)
    # past total_num_steps the lr sits at warmup_min_lr
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


# ---- WarmupCosineLR ----

@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    opt = make_optimizer(lrs=(0.1, 0.02))
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_min_ratio=0.2, warmup_num_steps=6,
                           cos_min_ratio=0.1, warmup_type=kind)
    expected = [[ref_cosine_lr(i, base, 6, 20, 0.2, 0.1, kind) for base in (0.1, 0.02)]
                for i in range(-1, STEPS)]
    assert_close(trajectory(sched), expected)
    # clamped at the floor after total_num_steps, never climbing back
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1)


def test_warmup_cosine_lr_starts_at_zero_and_stays_below_base():
    opt = make_optimizer(lrs=(0.3, 0.03))
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=3, warmup_type="linear")
    values = trajectory(sched, 10)
    assert values[0] == [0.0, 0.0]
    # DeepSpeed's cosine starts one step into the decay, so the base lr itself is never used
    assert max(v[0] for v in values) == pytest.approx(0.3 * (1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi / 7)) / 2))


# ---- OneCycle ----

ONE_CYCLE = dict(min_lr=0.01, max_lr=0.1, first=6, second=4, decay_step=2, lr_rate=0.5,
                 min_mom=0.8, max_mom=0.95, mom_rate=0.1)


def one_cycle(opt, c, **extra):
    return OneCycle(opt, cycle_min_lr=c["min_lr"], cycle_max_lr=c["max_lr"], decay_lr_rate=c["lr_rate"],
                    cycle_first_step_size=c["first"], cycle_second_step_size=c["second"],
                    decay_step_size=c["decay_step"], cycle_min_mom=c["min_mom"], cycle_max_mom=c["max_mom"],
                    decay_mom_rate=c["mom_rate"], **extra)


def test_one_cycle_lr_and_adam_betas():
    opt = make_optimizer("adam")
    sched = one_cycle(opt, ONE_CYCLE)
    lrs, betas = [], []
    for i in range(-1, STEPS):
        if i >= 0:
            sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        betas.append([g["betas"] for g in opt.param_groups])
    expected = [ref_one_cycle(i, ONE_CYCLE) for i in range(-1, STEPS)]
    assert_close(lrs, [[lr, lr] for lr, _ in expected])
    assert_close([[b[0][0]] for b in betas], [[mom] for _, mom in expected])
    # DeepSpeed writes (momentum, 0.99) into Adam's betas
    assert all(b[1] == 0.99 for row in betas for b in row)
    # the peak is reached at the end of the first half, the trough at the end of the cycle
    assert lrs[1 + 5][0] == pytest.approx(0.1)
    assert lrs[1 + 9][0] == pytest.approx(0.01)


def test_one_cycle_leaves_sgd_momentum_alone_as_deepspeed_does(caplog):
    # DeepSpeed cycles only Adam's beta1; cycling SGD's momentum would turn it on for a plain SGD
    c = dict(ONE_CYCLE, second=6, decay_step=0, lr_rate=0.0, mom_rate=0.0)
    for momentum in (0.0, 0.5):
        opt = make_optimizer("sgd")
        for g in opt.param_groups:
            g["momentum"] = momentum
        with caplog.at_level("WARNING", logger="zeroengine.optim.one_cycle"):
            sched = one_cycle(opt, c)
        assert not sched.cycle_momentum and "cycle_momentum disabled" in caplog.text
        moms = trajectory(sched, key="momentum")
        assert moms == [[momentum, momentum]] * len(moms)
        lrs = [[ref_one_cycle(i, c)[0]] * 2 for i in range(-1, STEPS)]
        assert_close(trajectory(one_cycle(make_optimizer("sgd"), c)), lrs)  # the lr is still cycled


def test_one_cycle_stairs():
    c = dict(ONE_CYCLE, first=8, second=4, stairs1=4, stairs2=2)
    opt = make_optimizer()
    sched = one_cycle(opt, c, cycle_first_stair_count=4, cycle_second_stair_count=2)
    expected = [[ref_one_cycle(i, c)[0]] * 2 for i in range(-1, STEPS)]
    values = trajectory(sched)
    assert_close(values, expected)
    assert len({round(v[0], 12) for v in values[:9]}) == 5  # 0, 1/4 .. 4/4 of the rise


def test_one_cycle_without_momentum_support_only_cycles_lr():
    opt = make_optimizer("adagrad")
    sched = one_cycle(opt, ONE_CYCLE)
    assert not sched.cycle_momentum
    trajectory(sched, 5)
    assert "betas" not in opt.param_groups[0] and "momentum" not in opt.param_groups[0]


def test_one_cycle_momentum_off_leaves_momentum():
    opt = make_optimizer("adam")
    one_cycle(opt, ONE_CYCLE, cycle_momentum=False).step()
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


# ---- shared behaviour ----

SCHEDULE_FACTORIES = {
    "WarmupLR": lambda opt, **kw: WarmupLR(opt, warmup_max_lr=[0.2, 0.02], warmup_num_steps=7, **kw),
    "WarmupDecayLR": lambda opt, **kw: WarmupDecayLR(opt, 20, warmup_max_lr=0.2, warmup_num_steps=7, **kw),
    "WarmupCosineLR": lambda opt, **kw: WarmupCosineLR(opt, 20, warmup_num_steps=7, warmup_min_ratio=0.1, **kw),
    "OneCycle": lambda opt, **kw: OneCycle(opt, 0.01, 0.2, decay_lr_rate=0.3, cycle_first_step_size=5,
                                           decay_step_size=3, **kw),
}


@pytest.mark.parametrize("name", sorted(SCHEDULE_FACTORIES))
def test_state_dict_round_trip_resumes_sequence(name):
    factory = SCHEDULE_FACTORIES[name]
    reference = trajectory(factory(make_optimizer("adam")), STEPS)

    opt = make_optimizer("adam")
    first = factory(opt)
    for _ in range(12):
        first.step()
    state = first.state_dict()
    # a fresh optimizer (lrs back at their configured values) and schedule, as on restart
    opt2 = make_optimizer("adam")
    resumed = factory(opt2)
    resumed.load_state_dict(state)
    assert_close([[g["lr"] for g in opt2.param_groups]], [reference[12]])
    assert_close(trajectory(resumed, STEPS - 12), reference[12:])


@pytest.mark.parametrize("name", sorted(SCHEDULE_FACTORIES))
def test_last_batch_iteration_constructor_argument(name):
    factory = SCHEDULE_FACTORIES[name]
    reference = trajectory(factory(make_optimizer("adam")), 15)
    opt = make_optimizer("adam")
    sched = factory(opt, last_batch_iteration=9)
    assert sched.last_batch_iteration == 9
    assert_close([[g["lr"] for g in opt.param_groups]], [reference[10]])
    assert_close(trajectory(sched, 5), reference[10:])


def test_cosine_state_keeps_base_lrs_even_if_optimizer_lr_moved():
    opt = make_optimizer(lrs=(0.1, 0.01))
    sched = WarmupCosineLR(opt, 20, warmup_num_steps=4)
    for _ in range(8):
        sched.step()
    state = sched.state_dict()
    # the restarted optimizer came from a checkpoint, so its lrs are already scheduled values
    restored = make_optimizer(lrs=[g["lr"] for g in opt.param_groups])
    resumed = WarmupCosineLR(restored, 20, warmup_num_steps=4)
    resumed.load_state_dict(state)
    assert resumed.base_lrs == [0.1, 0.01]
    assert_close(trajectory(resumed, 5), trajectory(sched, 5))


def test_tensor_lr_stays_a_tensor():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=torch.tensor(0.01), foreach=False)
    sched = WarmupLR(opt, warmup_max_lr=0.5, warmup_num_steps=4, warmup_type="linear")
    sched.step()
    sched.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(0.5 * 1 / 4)


@pytest.mark.parametrize("build, message", [
    (lambda o: WarmupLR(o, warmup_type="cosine"), "warmup_type"),
    (lambda o: WarmupLR(o, warmup_num_steps=-1), "warmup_num_steps"),
    (lambda o: WarmupLR(o, warmup_max_lr=[0.1, 0.2, 0.3]), "one per param group"),
    (lambda o: WarmupDecayLR(o, total_num_steps=10, warmup_num_steps=20), "total_num_steps"),
    (lambda o: WarmupDecayLR(o, total_num_steps=0), "total_num_steps"),
    (lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_num_steps=20), "total_num_steps"),
    (lambda o: WarmupCosineLR(o, 100, warmup_num_steps=10, cos_min_ratio=1.5), "cos_min_ratio"),
    (lambda o: WarmupCosineLR(o, 100, warmup_num_steps=10, warmup_type="exp"), "warmup_type"),
    (lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=0), "cycle_first_step_size"),
    (lambda o: OneCycle(o, 0.01, 0.1, cycle_first_stair_count=-1), "cycle_first_stair_count"),
    (lambda o: OneCycle(o, 0.01, 0.1, decay_step_size=-2), "decay_step_size"),
    (lambda o: WarmupLR(o, last_batch_iteration=-5), "last_batch_iteration"),
])
def test_bad_arguments_raise_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build(make_optimizer())


def test_build_scheduler_names_and_errors():
    opt = make_optimizer()
    params = {
        "WarmupLR": {"warmup_num_steps": 5},
        "WarmupDecayLR": {"total_num_steps": 50, "warmup_num_steps": 5},
        "WarmupCosineLR": {"total_num_steps": 50, "warmup_num_steps": 5},
        "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1},
    }
    assert set(params) == set(SCHEDULERS)
    for name, p in params.items():
        assert type(build_scheduler(name, p, opt)).__name__ == name
    with pytest.raises(ValueError, match="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"):
        build_scheduler("warmuplr", {}, opt)
    with pytest.raises(ValueError, match="warmup_max"):
        build_scheduler("WarmupLR", {"warmup_max": 0.1}, opt)
    with pytest.raises(ValueError, match="total_num_steps"):
        build_scheduler("WarmupDecayLR", {}, opt)
    assert isinstance(build_scheduler("WarmupLR", None, opt), WarmupLR)


# ---- against DeepSpeed itself, when it happens to be installed ----

def test_matches_deepspeed():
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    cases = [
        ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=7, warmup_type="log")),
        ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=7, warmup_type="linear")),
        ("WarmupDecayLR", dict(total_num_steps=20, warmup_max_lr=0.2, warmup_num_steps=7)),
        ("WarmupCosineLR", dict(total_num_steps=20, warmup_num_steps=7, warmup_min_ratio=0.1)),
        ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.2, decay_lr_rate=0.3, cycle_first_step_size=5,
                          cycle_second_step_size=3, decay_step_size=3, decay_mom_rate=0.05)),
    ]
    for name, params in cases:
        ours_opt, theirs_opt = make_optimizer("adam"), make_optimizer("adam")
        ours = build_scheduler(name, params, ours_opt)
        theirs = getattr(lr_schedules, name)(theirs_opt, **params)
        for _ in range(STEPS):
            ours.step()
            theirs.step()
            for a, b in zip(ours_opt.param_groups, theirs_opt.param_groups):
                assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-15), name
                assert tuple(a["betas"]) == pytest.approx(tuple(b["betas"])), name


@pytest.mark.parametrize("kind, params, key", [
    ("WarmupLR", {"warmup_max_lr": [0.1, 0.2], "warmup_num_steps": 5}, "warmup_max_lr"),
    ("OneCycle", {"cycle_min_lr": [0.01, 0.02], "cycle_max_lr": 0.1}, "cycle_min_lr"),
])
def test_a_per_group_list_of_the_wrong_length_is_a_config_error_naming_the_key(kind, params, key):
    # one value per param group can only be checked once the optimizer exists, in initialize()
    import torch.nn as nn

    import zeroengine
    from zeroengine.config import ConfigError

    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "scheduler": {"type": kind, "params": params}}
    with pytest.raises(ConfigError) as info:
        zeroengine.initialize(model=nn.Linear(2, 2), config=config)
    assert info.value.key_path == f"scheduler.params.{key}"
    assert "expected 1 values (one per param group), got 2" in str(info.value)
