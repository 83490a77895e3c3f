"""The engine around the user's own training code, stages 1-3: a user's post-accumulate-grad hook still sees
the gradient (stages 2-3 move it into a bucket at once) and a stage-3 module's forward hooks find its weights
gathered; a backward outside engine.backward() is refused, while gradients one engine's backward leaves on
another engine's parameters (a GAN) behave as in torch; a failed backward leaves nothing running; a model
cast after initialize, or compiled at stage 3, is caught with a reason; a zero-size parameter trains."""
import pytest
import torch
import torch.nn as nn
from parity import base_config

import zeroengine
from zeroengine.testing import run_distributed

WORLD = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)


def _grad_sums_seen_by_hooks(rank, world, stage):
    model = _model()
    seen = {}

    def logger(name):
        def hook(p):
            seen.setdefault(name, None if p.grad is None else p.grad.detach().clone())

        return hook

    model[0].weight.register_post_accumulate_grad_hook(logger("before"))
    engine, _, _, _ = zeroengine.initialize(model=model, config=base_config(3, 1, world, 0.0, stage=stage))
    model[2].weight.register_post_accumulate_grad_hook(logger("after"))
    x, y = _batch(rank)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    return seen


@pytest.mark.parametrize("stage", [2, 3])
def test_post_accumulate_grad_hooks_see_the_gradient(stage):
    # The engine's own hook used to run first and drop param.grad, so a hook added after initialize saw None.
    reference = _model()
    x, y = _batch(0)
    nn.functional.mse_loss(reference(x), y).backward()  # this rank's local gradient, as a hook sees it
    seen = run_distributed(_grad_sums_seen_by_hooks, WORLD, stage)[0]
    torch.testing.assert_close(seen["before"], reference[0].weight.grad)
    torch.testing.assert_close(seen["after"], reference[2].weight.grad)


def _plain_backward(rank, world, stage):
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=base_config(3, 1, world, 0.0, stage=stage))
    x, y = _batch(rank)
    try:
        nn.functional.mse_loss(engine(x), y).backward()
    except RuntimeError as err:
        message = str(err)
    else:
        message = ""
    engine.zero_grad()  # and the engine trains on as if that backward had not run
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    with zeroengine.zero.GatheredParameters(list(engine.module.parameters())):
        return message, [p.detach().clone() for p in engine.module.parameters()]


def _clean_step(rank, world, stage):
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=base_config(3, 1, world, 0.0, stage=stage))
    x, y = _batch(rank)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    with zeroengine.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [2, 3])
def test_loss_backward_outside_the_engine_is_refused_and_leaves_nothing_behind(stage):
    # Its bucket reductions used to stay queued through zero_grad() and land in the next step's gradient.
    results = run_distributed(_plain_backward, WORLD, stage)
    clean = run_distributed(_clean_step, WORLD, stage)
    for (message, params), want in zip(results, clean):
        assert "call engine.backward(loss) instead of loss.backward()" in message, message
        for got, expected in zip(params, want):
            assert torch.equal(got, expected)


def _cast_after_initialize(rank, world, stage):
    engine, _, _, _ = zeroengine.initialize(model=_model(), config=base_config(3, 1, world, 0.0, stage=stage))
    try:
        engine.half()
    except RuntimeError as err:
        hint = str(err)
    engine.module.double()  # what that hint used to suggest: the model leaves the engine's buffers
    x, y = _batch(rank)
    try:
        engine.backward(nn.functional.mse_loss(engine(x.double()), y.double()))
    except RuntimeError as err:
        return hint, str(err)
    return hint, ""


@pytest.mark.parametrize("stage", [1, 2])
def test_casting_the_model_after_initialize_is_caught_not_silently_untrained(stage):
    # Stage 2 went on with losses that never moved; stage 1 failed deep inside autograd.
    for hint, message in run_distributed(_cast_after_initialize, WORLD, stage):
        assert "the training dtype comes from the config" in hint and "engine.module.half" not in hint
        assert "was cast or moved after initialize" in message, message


def _compiled_at_stage3(rank, world, in_place=False):
    model = _model()
    if in_place:
        model.compile()  # nn.Module.compile: the module itself, compiled on its next call
    else:
        model = torch.compile(model)
    try:
        zeroengine.initialize(model=model, config=base_config(3, 1, world, 0.0, stage=3))
    except ValueError as err:
        return str(err)
    return ""


def test_torch_compile_at_stage3_is_refused_with_a_reason():
    # It failed inside dynamo, with a message saying the parameter was used outside the engine's forward.
    message = run_distributed(_compiled_at_stage3, 1)[0]
    assert message.startswith("torch.compile(model) is not supported at ZeRO stage 3"), message


def test_tracing_a_stage3_parameter_names_torch_compile(monkeypatch):
    from zeroengine.zero import param_guard

    class Info:
        name, shape = "fc.weight", (4, 2)

    class Param:
        _ze = Info()

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert param_guard._message(Param(), "is_mkldnn.__get__").startswith(
        "torch.compile is not supported at ZeRO stage 3: tracing reached the partitioned parameter 'fc.weight'")


def _hooks_reading_weights(rank, world):
    model = _model()
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(("pre", m.weight.sum().item())))
    engine, _, _, _ = zeroengine.initialize(model=model, config=base_config(3, 1, world, 0.0, stage=3))
    model[0].register_forward_hook(lambda m, args, out: seen.append(("post", m.weight.sum().item())))
    engine(_batch(rank)[0])
    return seen


def test_stage3_forward_hooks_that_read_weights_find_them_gathered():
    # zeroengine's own hooks ran inside the user's: a pre-hook registered before initialize, or a forward hook
    # registered after it, met the partitioned placeholder
    want = _model()[0].weight.sum().item()
    for seen in run_distributed(_hooks_reading_weights, WORLD):
        assert [kind for kind, _ in seen] == ["pre", "post"]
        assert all(abs(value - want) < 1e-5 for _, value in seen), seen


def _gan(rank, world, stage, g_stage=None):
    """DeepSpeedExamples' GAN loop: the generator's loss flows through the discriminator's parameters during
    the generator engine's backward; those gradients stay in .grad (as in torch) until d.zero_grad()."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g_stage = stage if g_stage is None else g_stage
    g, _, _, _ = zeroengine.initialize(model=G, config=base_config(3, 1, world, 0.0, stage=g_stage))
    d, _, _, _ = zeroengine.initialize(model=D, config=base_config(3, 1, world, 0.0, stage=stage))
    bce = nn.BCEWithLogitsLoss()
    for it in range(3):
        gen = torch.Generator().manual_seed(it * 10 + rank)
        real, z = torch.randn(3, 8, generator=gen), torch.randn(3, 4, generator=gen)
        d.zero_grad()
        fake = g(z)
        d.backward(bce(d(real), torch.ones(3, 1)) + bce(d(fake.detach()), torch.zeros(3, 1)))
        d.step()
        g.zero_grad()
        g.backward(bce(d(fake), torch.ones(3, 1)))
        if stage == 3:  # the discriminator's parameters are free again once the generator's backward is over
            assert d.optimizer.fetch_stats()["live_numel"] == 0
        g.step()
    with zeroengine.zero.GatheredParameters(list(G.parameters()) + list(D.parameters())):
        return [p.detach().clone() for p in list(G.parameters()) + list(D.parameters())]


@pytest.mark.parametrize("stage,g_stage", [(2, 2), (3, 3), (3, 1)])  # (the discriminator's, the generator's)
def test_two_engines_whose_losses_cross_train_as_at_stage_0(stage, g_stage):
    # The stray discriminator gradients used to be reduced into its next step (stages 2-3), then refused.
    want = run_distributed(_gan, WORLD, 0)
    for got, ref in zip(run_distributed(_gan, WORLD, stage, g_stage), want):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


def _with_an_empty_parameter(world, stage):
    model = _model()
    model.register_parameter("empty", nn.Parameter(torch.zeros(0)))  # a zero-size parameter trains too
    engine, _, _, _ = zeroengine.initialize(model=model, config=base_config(3, 1, world, 0.0, stage=stage))
    return engine


def _failed_backward_then_plain(rank, world, stage):
    engine = _with_an_empty_parameter(world, stage)
    x, y = _batch(rank)
    out = engine(x)
    with pytest.raises(ValueError, match="boom"):
        engine.backward(nn.functional.mse_loss(_Boom.apply(out) + 0 * out.sum(), y))
    engine.zero_grad()
    with pytest.raises(RuntimeError, match="call engine.backward"):
        nn.functional.mse_loss(engine(x), y).backward()  # still refused: the failed one did not leave it "inside"
    engine.zero_grad()
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_a_failed_engine_backward_leaves_no_backward_running(stage):
    assert all(run_distributed(_failed_backward_then_plain, WORLD, stage))


def _zero_size(rank, world, stage):
    engine = _with_an_empty_parameter(world, stage)
    x, y = _batch(rank)
    for _ in range(2):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_size_parameter_is_not_taken_for_a_cast_model(stage):
    # an empty tensor's data_ptr is 0, outside the flat buffer
    assert all(run_distributed(_zero_size, WORLD, stage))


def test_module_compile_in_place_is_refused_at_stage3_too():
    assert run_distributed(_compiled_at_stage3, 1, True)[0].startswith("torch.compile(model) is not supported")


class _DiscriminatorWithHead(nn.Module):
    """A discriminator whose head only the generator's loss uses: its gradient is all stray."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.head = nn.Linear(8, 1)

    def forward(self, x, generator_side=False):
        return self.body(x) + (self.head(x) if generator_side else 0)


def _gan_stray_only(rank, world, stage):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    D = _DiscriminatorWithHead()
    g, _, _, _ = zeroengine.initialize(model=G, config=base_config(3, 1, world, 0.0, stage=stage))
    d, _, _, _ = zeroengine.initialize(model=D, config=base_config(3, 1, world, 0.0, stage=stage))
    bce = nn.BCEWithLogitsLoss()
    for it in range(3):
        gen = torch.Generator().manual_seed(it * 10 + rank)
        real, z = torch.randn(3, 8, generator=gen), torch.randn(3, 4, generator=gen)
        fake = g(z)
        g.backward(bce(d(fake, True), torch.ones(3, 1)))  # no d.zero_grad(): D steps with these too, as torch
        g.step()
        d.backward(bce(d(real), torch.ones(3, 1)) + bce(d(fake.detach()), torch.zeros(3, 1)))
        d.step()
    with zeroengine.zero.GatheredParameters(list(D.parameters())):
        return [p.detach().clone() for p in D.parameters()]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_stray_gradient_on_a_parameter_the_owner_s_loss_does_not_reach_is_stepped_as_in_torch(stage):
    # it stayed in .grad through the owner's backward, and its step dropped it
    want = run_distributed(_gan_stray_only, WORLD, 0)
    for got, ref in zip(run_distributed(_gan_stray_only, WORLD, stage), want):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
