"""Stage 3 with what real models do: tied weights, a module called twice, a module skipped on some
steps, evaluation under no_grad / eval mode, and GatheredParameters edits."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroengine
from zeroengine.testing import run_distributed
from zeroengine.zero import GatheredParameters

V, D = 32, 16


class Quirky(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.shared = nn.Linear(D, D)  # called twice per forward
        self.sometimes = nn.Linear(D, D)  # used on odd steps only
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x, y, use_sometimes: bool):
        h = torch.tanh(self.shared(self.emb(x)))
        h = torch.tanh(self.shared(h))
        if use_sometimes:
            h = h + self.sometimes(h)
        return F.cross_entropy(self.head(self.norm(h)).view(-1, V), y.view(-1))


def _model():
    torch.manual_seed(0)
    return Quirky()


def _batches(steps, world):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(V, (world * 2, 8), generator=g), torch.randint(V, (world * 2, 8), generator=g))
            for _ in range(steps)]


def _reference(steps, world):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    for i, (x, y) in enumerate(_batches(steps, world)):
        model(x, y, use_sometimes=i % 2 == 1).backward()
        # ZeRO semantics (DeepSpeed's too): a parameter unused in a step is stepped with a zero
        # gradient (its Adam moments decay and weight decay applies), where plain torch skips it.
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(world):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "gradient_clipping": 0,  # the reference does not clip
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 300,
                                  "stage3_param_persistence_threshold": 0}}


def _train(rank, world, steps):
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=_config(world))
    for i, (x, y) in enumerate(_batches(steps, world)):
        loss = engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2], use_sometimes=i % 2 == 1)
        engine.backward(loss)
        engine.step()
    # evaluation: no_grad and eval mode gather and release without any backward
    engine.eval()
    with torch.no_grad():
        x, y = _batches(1, world)[0]
        eval_loss = engine(x, y, use_sometimes=True).item()
    held_after_eval = engine.memory_breakdown()["params"]
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return state, eval_loss, held_after_eval, engine.optimizer.layout.shard_numel * 4


def test_stage3_quirky_model_matches_single_process():
    steps, world = 4, 2
    ref = _reference(steps, world)
    ref_model = _model()
    ref_model.load_state_dict(ref)
    x, y = _batches(1, world)[0]
    with torch.no_grad():
        ref_eval = ref_model.eval()(x, y, use_sometimes=True).item()
    for state, eval_loss, held, shard_bytes in run_distributed(_train, world, steps):
        for name, want in ref.items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        assert abs(eval_loss - ref_eval) < 1e-5
        assert held == shard_bytes  # nothing stays gathered after evaluation


def _modify(rank, world):
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=_config(world))
    with GatheredParameters([engine.module.shared.weight], modifier_rank=0):
        if rank == 0:
            engine.module.shared.weight.data.fill_(0.5)
    x, y = _batches(1, world)[0]
    engine.backward(engine(x[:2], y[:2], use_sometimes=False))
    engine.step()  # the optimizer must start from the edited value, not the old master
    with GatheredParameters([engine.module.shared.weight]):
        w = engine.module.shared.weight.detach().clone()
    return w


def test_gathered_parameters_broadcasts_the_modifiers_edit_into_every_shard_and_master():
    for w in run_distributed(_modify, 2):
        assert w.shape == (D, D)
        # one AdamW step of lr 1e-2 moves each element by at most ~lr from the edited 0.5
        assert torch.all((w - 0.5).abs() <= 1.1e-2), w


def _path_change(rank, world, steps):
    """Steps 0-2 without `sometimes`, steps 3-5 with it: the recorded trace must be dropped and re-recorded."""
    engine, opt, _, _ = zeroengine.initialize(model=_model(), config=_config(world))
    on_demand = []
    for i, (x, y) in enumerate(_batches(steps, world)):
        before = opt.fetch_stats()["on_demand"]
        engine.backward(engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2], use_sometimes=i >= 3))
        engine.step()
        on_demand.append(opt.fetch_stats()["on_demand"] - before)
    stats = opt.fetch_stats()
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return on_demand, stats, state


def _reference_path_change(steps, world):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    for i, (x, y) in enumerate(_batches(steps, world)):
        model(x, y, use_sometimes=i >= 3).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_changed_module_order_drops_the_trace_and_records_it_again():
    steps, world = 6, 2
    ref = _reference_path_change(steps, world)
    for on_demand, stats, state in run_distributed(_path_change, world, steps):
        for name, want in ref.items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        assert stats["trace_divergences"] == 1 and stats["trace_recordings"] == 2
        # step 0 records, 1-2 replay (one blocking gather each), 3 leaves the trace (on demand from
        # there), 4 records the new order, 5 replays it
        assert on_demand[1] == on_demand[2] == on_demand[5] == 1, on_demand
        assert on_demand[3] > 1 and on_demand[4] > 1, on_demand


class TransposedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x):
        return torch.tanh(x @ self.weight.t())


class Positions(nn.Module):
    """Returns a view of its own parameter (a learned position table sliced to the input's length), which
    its caller reads after this module's post-forward release: that memory must stay the table's values."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, D) * 0.3)

    def forward(self, n: int):
        return self.table[:n]


class SavesViews(nn.Module):
    """Layers that use ``x @ w.t()``: autograd saves the view ``w.t()`` of the gathered buffer, not the
    parameter, so a released buffer must not be reused (or freed) while that view waits for backward.
    The last layer's weights sit in a ParameterList (a container that never runs forward itself).
    ``positions`` returns a view of its parameter (that process segfaulted before)."""

    def __init__(self):
        super().__init__()
        self.positions = Positions()
        self.layers = nn.ModuleList(TransposedLinear() for _ in range(4))
        self.extra = nn.ParameterList(nn.Parameter(torch.randn(D, D) * 0.3) for _ in range(2))

    def forward(self, x):
        x = x + self.positions(x.shape[0])
        for layer in self.layers:
            x = layer(x)
        for w in self.extra:
            x = torch.tanh(x @ w.t())
        return x.square().mean()


def _views_model():
    torch.manual_seed(0)
    return SavesViews()


def _views_train(rank, world, steps):
    cfg = _config(world)
    # release right after forward and prefetch little: buffers are freed and reused within the pass
    cfg["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=D * D)
    engine, _, _, _ = zeroengine.initialize(model=_views_model(), config=cfg)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(world * 2, D, generator=g)
        engine.backward(engine(x[rank * 2:(rank + 1) * 2]))
        engine.step()
    with GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_views_saved_for_backward_keep_their_values():
    steps, world = 3, 2
    model = _views_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(world * 2, D, generator=g)
        (sum(model(x[r * 2:(r + 1) * 2]) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    for state in run_distributed(_views_train, world, steps):
        for name, want in model.state_dict().items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def _read_only_edits(rank, world):
    from zeroengine.zero import Init
    with Init():
        built = nn.Linear(8, 8)
    with GatheredParameters(list(built.parameters())):  # read-only: no modifier_rank
        if rank == 0:
            built.weight.data.fill_(7.0)
    with GatheredParameters(list(built.parameters())):
        init_values = built.weight.detach().clone()
    cfg = _config(world)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10 ** 6  # kept whole: already gathered
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=cfg)
    x = _batches(1, world)[0][0][:2]
    before = engine.module.emb(x).detach().clone()
    with GatheredParameters([engine.module.emb.weight]):
        if rank == 0:
            engine.module.emb.weight.data.fill_(7.0)
    return (init_values == 7.0).sum().item(), torch.equal(engine.module.emb(x), before)


def test_read_only_gathered_parameters_drop_edits_on_every_rank():
    # DeepSpeed drops an edit made without modifier_rank; before, an Init model kept rank 0's edit in rank
    # 0's slice only (half the elements), and a persistent parameter in rank 0's live copy only
    for edited, unchanged in run_distributed(_read_only_edits, 2):
        assert edited == 0 and unchanged


def test_fwd_module_is_refused_by_name():
    import pytest
    with pytest.raises(NotImplementedError, match="fwd_module"):
        GatheredParameters([], fwd_module=nn.Linear(1, 1))


class WithIdTable(nn.Module):
    """An integer parameter (an index table, frozen): not partitioned, never cast."""

    def __init__(self):
        super().__init__()
        self.ids = nn.Parameter(torch.tensor([3, 16777217 % V, 1]), requires_grad=False)
        self.big = nn.Parameter(torch.tensor([16777217]), requires_grad=False)  # not a float32 number
        self.emb = nn.Embedding(V, D)

    def forward(self, x):
        return self.emb(x)[:, self.ids].square().mean()


def _int_param(rank, world, save_dir):
    from zeroengine.zero import Init
    with Init():
        model = WithIdTable()
    engine, _, _, _ = zeroengine.initialize(model=model, config=_config(world))
    engine.backward(engine(torch.randint(V, (2, 4))))
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    engine.load_checkpoint(save_dir, tag="t")
    return engine.module.ids.dtype, engine.module.big.tolist()


def test_integer_parameters_stay_whole_and_exact(tmp_path):
    for dtype, big in run_distributed(_int_param, 2, str(tmp_path / "run")):
        assert dtype == torch.int64 and big == [16777217]


def _forward_inside_gathered(rank, world):
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=_config(world))
    x, y = _batches(1, world)[0]
    params = list(engine.module.parameters())
    with torch.no_grad(), GatheredParameters(params):
        loss = engine.module(x, y, use_sometimes=True)  # e.g. generate() or an evaluation inside the block
        still_whole = engine.module.shared.weight.sum().item()  # the forward's hooks must not release it
    with GatheredParameters([engine.module.shared.weight], modifier_rank=0):
        engine.module(x, y, use_sometimes=True)
        if rank == 0:
            with torch.no_grad():
                engine.module.shared.weight.fill_(0.25)
    with GatheredParameters([engine.module.shared.weight]):
        edited = engine.module.shared.weight.detach().clone()
    return loss.item(), still_whole, edited, engine.memory_breakdown()["params"], engine.optimizer.layout.shard_numel * 4


def test_a_forward_inside_gathered_parameters_keeps_them_gathered_until_the_block_ends():
    # Before, the forward's hooks released the block's buckets: reading a parameter after it raised, and the
    # exit crashed (a None bucket), losing a modifier's edit.
    ref = _model()
    x, y = _batches(1, 2)[0]
    with torch.no_grad():
        want = ref(x, y, use_sometimes=True).item()
    for loss, whole, edited, held, shard_bytes in run_distributed(_forward_inside_gathered, 2):
        assert abs(loss - want) < 1e-6 and abs(whole - ref.shared.weight.sum().item()) < 1e-5
        assert torch.equal(edited, torch.full((D, D), 0.25))
        assert held == shard_bytes  # released on exit


def _modifier_at_stage0(rank, world):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zeroengine").addHandler(handler)
    cfg = {**_config(world), "zero_optimization": {"stage": 0}}  # stages 1-2 broadcast them on exit
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=cfg)
    with GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        pass
    return [r.getMessage() for r in records if "pass through untouched" in r.getMessage()]


def test_a_modifier_block_over_unpartitioned_parameters_warns_that_edits_stay_on_one_rank():
    for messages in run_distributed(_modifier_at_stage0, 2):
        assert len(messages) == 1 and "Load or edit them on every rank" in messages[0], messages
