"""Stage 3 misuse fails loudly and says what to do: a partitioned parameter used outside the engine, and
ranks that run different modules (named by every rank, with or without comm_debug; a rank that leaves the
pass early is reported within the check's deadline instead of hanging)."""
import io
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import base_config, make_model

import zeroengine
from zeroengine import comm
from zeroengine.testing import run_distributed
from zeroengine.testing.harness import DistributedTestError
from zeroengine.zero import GatheredParameters, PartitionedParameterError
from zeroengine.zero.gather_order import Stage3DivergenceError


def _raises(fn) -> str:
    try:
        fn()
    except PartitionedParameterError as exc:
        return str(exc)
    return ""


def _touch_outside(rank, world):
    model = make_model()
    num_params = model.num_params()
    engine, _, _, _ = zeroengine.initialize(model=model, config=base_config(2, 1, world, 0.0, stage=3))
    head = engine.module.head.weight  # tied to wte.weight
    x = torch.randn(3, head.shape[1])
    errors = {
        "matmul": _raises(lambda: x @ head.t()),
        "data": _raises(lambda: head.data.fill_(0)),
        # state_dict() lists the partitioned parameters (names, full shapes); saving or reading them refuses.
        "state_dict": _raises(lambda: torch.save(engine.module.state_dict(), io.BytesIO())),
        "state_dict values": _raises(lambda: engine.module.state_dict()["head.weight"] * 2),
        "keyword": _raises(lambda: torch.add(torch.zeros(64, 32), other=head)),  # passed by keyword
        "nn.init": _raises(lambda: torch.nn.init.normal_(head, std=0.02)),  # nn.init passes tensor=head
    }
    shape_ok = head.shape == (64, 32) and head.dim() == 2 and head.size(0) == 64
    counted = sum(p.numel() for p in engine.module.parameters())
    with GatheredParameters([head]):
        inside = (x @ head.t()).shape  # fine while gathered
    return errors, shape_ok, counted == num_params, inside


def test_a_partitioned_parameter_used_outside_the_engine_raises_a_clear_error():
    for errors, shape_ok, counted, inside in run_distributed(_touch_outside, 2):
        for op in ("matmul", "data", "state_dict", "state_dict values", "keyword", "nn.init"):
            msg = errors[op]
            assert "'wte.weight'" in msg and "(64, 32)" in msg, (op, msg)
            assert "GatheredParameters" in msg and "safe_get_full_fp32_param" in msg, (op, msg)
        assert shape_ok and counted  # metadata still describes the full parameter
        assert inside == (3, 64)


def _state_dict_at_stage3(rank, world):
    from safetensors.torch import save_file

    model = make_model()
    names = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    engine, _, _, _ = zeroengine.initialize(model=model, config=base_config(2, 1, world, 0.0, stage=3))
    listed = {n: tuple(t.shape) for n, t in engine.module.state_dict().items()}
    safetensors_error = _raises(lambda: save_file(dict(engine.module.state_dict()), os.devnull))
    with GatheredParameters(list(engine.module.parameters())):
        full = {n: tuple(t.shape) for n, t in engine.module.state_dict().items() if t.numel() == 0}
    return names == listed, safetensors_error, full


def test_state_dict_at_stage3_lists_every_weight_and_never_saves_an_empty_one():
    """What Hugging Face's from_pretrained needs (the names and full shapes of model.state_dict()), without
    DeepSpeed's empty placeholders reaching a file: safetensors, like torch.save, is refused with the way out."""
    for same_names_and_shapes, error, empty_inside in run_distributed(_state_dict_at_stage3, 2):
        assert same_names_and_shapes
        assert "holds no values here" in error and "stage3_gather_16bit_weights_on_model_save" in error, error
        assert empty_inside == {}  # inside GatheredParameters the state_dict holds the full values


# -- ranks taking different code paths ------------------------------------------------------

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.sometimes = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, skip: bool):
        h = torch.tanh(self.inp(x))
        if not skip:
            h = h + self.sometimes(h)
        return F.mse_loss(self.out(h), torch.zeros(x.shape[0], 4))


def _diverge(rank, world):
    torch.manual_seed(0)
    cfg = base_config(2, 1, world, 0.0, stage=3)
    cfg["comm_debug"] = True
    engine, _, _, _ = zeroengine.initialize(model=Branchy(), config=cfg)
    comm.enable_sequence_check(timeout_s=10)  # shorter than the default 60 s, for the test
    message = ""
    try:
        loss = engine(torch.randn(2, 8), skip=rank == 1)  # rank 1 skips `sometimes`
        engine.backward(loss)
    except comm.CollectiveMismatchError as exc:
        message = str(exc)
    # Rank 0 hosts the store the check talks through: it must not exit before rank 1 has read it.
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    store.set(f"test_done/{rank}", b"1")
    store.wait([f"test_done/{r}" for r in range(world)], timedelta(seconds=30))
    return message


def test_a_module_skipped_on_one_rank_is_named_instead_of_hanging():
    for message in run_distributed(_diverge, 2, timeout_s=60):
        assert "module sometimes (forward)" in message, message
        assert "module out (forward)" in message, message
        assert "rank 0" in message and "rank 1" in message


# -- the same without comm_debug: stage 3 checks its own gathers -----------------------------------------

def _diverge_plain(rank, world, skipper):
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=Branchy(), config=base_config(2, 1, world, 0.0, stage=3))
    try:
        loss = engine(torch.randn(2, 8), skip=rank == skipper)
        engine.backward(loss)
    except Stage3DivergenceError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("world", [2, 4])
def test_a_module_skipped_on_one_rank_is_named_by_every_rank_without_comm_debug(world):
    skipper = world - 1
    messages = run_distributed(_diverge_plain, world, skipper, timeout_s=120)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: ranks diverged at stage-3 check"), message
        for other in range(world):
            expected = "module out (forward), needing bucket" if other == skipper else \
                "module sometimes (forward), needing bucket"
            line = message.split(f"\n  rank {other}: ")[1].split("\n")[0]
            assert line.startswith(expected), (other, line)


def _diverge_after_the_trace(rank, world, skip_step):
    os.environ["ZEROENGINE_STAGE3_ORDER_CHECK"] = "event"  # read when the engine is built
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=Branchy(), config=base_config(2, 1, world, 0.0, stage=3))
    start = time.monotonic()
    for step in range(skip_step + 1):
        try:
            loss = engine(torch.randn(2, 8), skip=rank == 1 and step == skip_step)
            engine.backward(loss)
            engine.step()
        except Stage3DivergenceError as exc:
            return step, str(exc), time.monotonic() - start
    return step, "", time.monotonic() - start


def test_per_event_checks_name_a_module_skipped_once_the_prefetch_order_is_recorded_at_once():
    # From the second step on, prefetch gathers ahead along the recorded order: the skipping rank's next
    # module was already fetched, so it gathers nothing there. With ZEROENGINE_STAGE3_ORDER_CHECK=event the
    # ranks' fetch events are still compared one by one, so the divergence is named at the module, before
    # any gather can pair wrongly (even ones of different sizes, which abort gloo).
    messages = run_distributed(_diverge_after_the_trace, 2, 2, timeout_s=120)
    for rank, (step, message, seconds) in enumerate(messages):
        assert step == 2 and message.startswith(f"rank {rank}: ranks diverged at stage-3 check"), (step, message)
        assert "rank 0: module sometimes (forward)" in message and "rank 1: module out (forward)" in message
        assert "Nothing was gathered" in message
        assert seconds < 60, seconds


def _diverge_by_default(rank, world, skip_step, log_dir):
    import logging

    log = open(os.path.join(log_dir, f"rank{rank}.log"), "a", buffering=1)
    logging.getLogger("zeroengine").addHandler(logging.StreamHandler(log))
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=Branchy(), config=base_config(2, 1, world, 0.0, stage=3))
    for step in range(skip_step + 1):
        loss = engine(torch.randn(2, 8), skip=rank == 1 and step == skip_step)
        engine.backward(loss)
        engine.step()
        print(f"rank {rank} applied step {step}", file=log)
    return step


def test_by_default_a_rank_leaving_the_recorded_order_names_itself_before_its_next_gather(tmp_path):
    # The default check compares a replayed pass once, at its end. Rank 1's departure from the recorded order
    # desynchronises the gathers (here in sizes too, so gloo aborts a process before the pass ends); the rank
    # named itself and the module before its next collective, and no rank applied the step.
    with pytest.raises(DistributedTestError):
        run_distributed(_diverge_by_default, 2, 2, str(tmp_path), timeout_s=120, env={"ZEROENGINE_COMM_TIMEOUT": "20"})
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert logs[1].count("stage 3 left its recorded") == 1 and (
        "rank 1: stage 3 left its recorded parameter-fetch order at module out (forward), where the trace has "
        "module sometimes (forward)") in logs[1], logs[1]
    for rank, log in enumerate(logs):
        assert f"rank {rank} applied step 1" in log and "applied step 2" not in log, log


def _compare_passes(rank, world, diverge: bool):
    from zeroengine.zero.gather_order import GatherOrderCheck

    modules = ["inp", "a", "b", "out"]
    check = GatherOrderCheck({0: [[f"{m}.weight"] for m in modules]})
    comm.counters.reset()
    for replaying in (False, True):  # a recorded pass compares each event; a replayed one, the pass at its end
        check.begin_pass(replaying)
        swap = diverge and replaying and rank == 1
        try:
            for module in ["inp", "b" if swap else "a", "out"]:
                bucket = modules.index(module)
                with check.event(module, "forward", (0, bucket), (bucket,)):
                    pass
            check.end_pass()
        except Stage3DivergenceError as exc:
            return replaying, str(exc), comm.counters.snapshot()["control"]["calls"]
    return None, "", comm.counters.snapshot()["control"]["calls"]


def test_a_replayed_pass_is_compared_once_at_its_end_and_a_difference_names_each_ranks_fetch():
    # Ranks that agree: 3 exchanges for the recorded pass (one per event), 1 for the replayed one.
    assert run_distributed(_compare_passes, 2, False) == [(None, "", 4)] * 2
    for rank, (replaying, message, calls) in enumerate(run_distributed(_compare_passes, 2, True)):
        assert replaying is True and calls == 5, (replaying, calls)  # the end of the pass, then the rows
        assert message.startswith(f"rank {rank}: ranks diverged at stage-3 check #5;"), message
        assert "rank 0: module a (forward), needing bucket 1 [a.weight]" in message, message
        assert "rank 1: module b (forward), needing bucket 2 [b.weight]" in message, message
        assert "compared at its end" in message


class StopsEarly(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, stop: bool):
        h = torch.tanh(self.inp(x))
        return h.pow(2).mean() if stop else F.mse_loss(self.out(h), torch.zeros(x.shape[0], 4))


def _stop_early(rank, world):
    os.environ["ZEROENGINE_HANDSHAKE_TIMEOUT"] = "5"  # the check's deadline (read when the engine is built)
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=StopsEarly(), config=base_config(2, 1, world, 0.0, stage=3))
    start = time.monotonic()
    try:
        loss = engine(torch.randn(2, 8), stop=rank == 1)  # rank 1 never runs `out` ...
        if rank == 1:
            comm.barrier()  # ... and runs a collective of its own instead of stage 3's next gather
        engine.backward(loss)
    except Exception as exc:  # rank 1 fails in its barrier once rank 0 has given up and gone
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "", time.monotonic() - start


def test_a_rank_running_other_collectives_is_reported_within_the_deadline_not_hung():
    # rank 1 stays in its barrier until rank 0 has gone: rank 0 need not linger for it to leave first
    name, message, seconds = run_distributed(_stop_early, 2, timeout_s=120, store_linger_s=1.0)[0]
    assert name == "Stage3DivergenceError", (name, message)
    assert "check #" in message and "module out (forward)" in message and "was not joined by every rank" in message
    assert seconds < 60, seconds


def _gathered_on_rank0_only(rank, world):
    torch.manual_seed(0)
    engine, _, _, _ = zeroengine.initialize(model=Branchy(), config=base_config(2, 1, world, 0.0, stage=3))
    try:
        if rank == 0:
            with GatheredParameters(list(engine.module.parameters())):
                pass
        engine(torch.randn(2, 8), skip=False)
    except Stage3DivergenceError as exc:
        return str(exc)
    return ""


def test_gathered_parameters_entered_on_one_rank_only_is_named_by_every_rank():
    for message in run_distributed(_gathered_on_rank0_only, 2, timeout_s=120):
        line = message.split("\n  rank 0: ")[1].split("\n")[0]
        assert "for zeroengine.zero.GatheredParameters (collective: every rank must enter it)" in line, message


# -- assigning .data -------------------------------------------------------------------------------

def _assign_data(rank, world):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zeroengine.initialize(model=nn.Linear(4, 4), config=cfg)
    weight = engine.module.weight
    outside = _raises(lambda: setattr(weight, "data", torch.ones(4, 4)))
    engine.module.to(torch.float32)  # a no-op conversion assigns the placeholder back: still fine
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data = torch.full((4, 4), 2.0)  # the modifier's replacement is kept ...
    with GatheredParameters([weight]):
        kept = weight.detach().clone()
        weight.data = torch.full((4, 4), 3.0)  # ... a read-only block's is dropped
    with GatheredParameters([weight]):
        dropped = weight.detach().clone()
    engine.backward(engine(torch.ones(1, 4)).sum())  # and the parameter still trains from the bucket
    engine.step()
    return outside, kept, dropped


def test_assigning_data_is_refused_outside_and_kept_for_the_modifier_inside_gathered_parameters():
    # Before, `param.data = t` on a partitioned parameter was silently lost, inside GatheredParameters too.
    for outside, kept, dropped in run_distributed(_assign_data, 2):
        assert "`weight.data = ...`" in outside and "GatheredParameters([param], modifier_rank=0)" in outside
        assert torch.equal(kept, torch.full((4, 4), 2.0)) and torch.equal(dropped, kept)


def _assign_true(rank, world):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zeroengine.initialize(model=nn.Sequential(nn.Linear(4, 4)), config=cfg)
    engine.module.load_state_dict({"0.weight": torch.full((4, 4), 0.01), "0.bias": torch.zeros(4)}, assign=True)
    return _raises(lambda: engine(torch.ones(1, 4)))


def test_a_parameter_swapped_after_initialize_is_refused_instead_of_never_training():
    # Before, load_state_dict(assign=True) put plain Parameters in place that the engine never updated.
    for message in run_distributed(_assign_true, 2):
        assert "0.weight was replaced by a new Parameter" in message, message
        assert "load_state_dict(assign=True)" in message and "GatheredParameters" in message


def _legitimate_swaps(rank, world):
    import torch.nn.utils.parametrize as parametrize

    class Scale(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    engine, _, _, _ = zeroengine.initialize(model=model, config=cfg)
    with GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        parametrize.register_parametrization(engine.module[0], "weight", Scale())  # moves the object
    engine.backward(engine(torch.ones(1, 4)).sum())  # a moved (not new) parameter trains on
    engine.step()
    out = torch.func.functional_call(engine.module, {"2.bias": torch.zeros(4)}, (torch.ones(1, 4),), strict=False)
    engine.module[1].weight = nn.Parameter(torch.ones(4))  # a persistent (small) parameter, really replaced
    return out.shape, _raises(lambda: engine(torch.ones(1, 4)))


def test_moving_a_parameter_is_fine_and_replacing_a_persistent_one_is_refused():
    for shape, message in run_distributed(_legitimate_swaps, 2):
        assert shape == (1, 4)
        assert "1.weight was replaced by a new Parameter" in message, message


# -- a local failure inside a gather keeps its own type and message ----------------------------------------

def _local_failure_in_a_gather(rank, world):
    engine, _, _, _ = zeroengine.initialize(model=Branchy(), config=base_config(2, 1, world, 0.0, stage=3))
    real = comm.all_gather

    def out_of_memory(*args, **kwargs):  # what staging an offloaded shard on a full device raises
        raise RuntimeError("simulated: out of memory staging a shard")

    comm.all_gather = out_of_memory
    try:
        engine(torch.randn(2, 8), skip=False)
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        return type(exc), str(exc)
    finally:
        comm.all_gather = real
    return None, ""


def test_a_local_error_in_a_stage3_gather_is_not_reported_as_ranks_diverging():
    # It used to come back as a collective error telling the user the ranks ran different modules.
    for kind, message in run_distributed(_local_failure_in_a_gather, 2, timeout_s=60):
        assert kind is RuntimeError and not issubclass(kind, comm.CollectiveError), (kind, message)
        assert message == "simulated: out of memory staging a shard"
