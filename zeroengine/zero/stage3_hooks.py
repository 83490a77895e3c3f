"""Stage 3's module hooks: module calls become fetch events; the :class:`Fetcher` decides what to gather.

The parameters are grouped in *units*: one bucket of a partitioned buffer
(trainable parameters in the optimizer's buffer, frozen ones in a buffer of
their own). For every module that directly owns partitioned parameters (or,
with ``stage3_fetch_unit: "block"`` and under ``engine.compile()``, every
block, for its whole subtree):

* forward pre-hook: a fetch event for the units holding them (the fetcher
  gathers them, and prefetches along the recorded trace: :mod:`.fetcher`);
* forward post-hook: the call is done with them (the fetcher releases them,
  or keeps them when the trace says they are needed again soon); when
  autograd will come back through this module, a hook on its outputs fires
  a backward fetch event just before its backward runs;
* trainable units are released by the gradient store's
  :meth:`Stage3Hooks.on_bucket_grads_ready` once every gradient of the bucket
  exists (no backward computation needs them after that); frozen units once
  the module's input gradients exist (its backward is done), or at the end
  of backward.

Tied parameters (GPT-2's embedding and head) live in the unit of the module
registered first (the embedding: see ``split_params``); any module using them
fetches that unit. Persistent units (small
parameters, ``stage3_param_persistence_threshold``) are never fetched here:
they stay gathered.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from zeroengine.activation_checkpointing.checkpoint import register_recompute_context

from .external import external_parameters, unwatch_registrations, watch_registrations
from .fetcher import Fetcher, FetchPolicy, Unit
from .layout import Bucket
from .param_guard import PartitionedParameterError
from .prefetch import FetchEvent, TraceState

_CONTAINERS = (torch.nn.ParameterList, torch.nn.ParameterDict, torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass
class _FrozenHold:
    """One module call's frozen units, and whether its backward has started (see _watch_backward_done)."""

    units: tuple[int, ...]
    started: bool = False


class Stage3Hooks:
    def __init__(self, module: torch.nn.Module, units: list[Unit], unit_of_param: dict[int, int],
                 policy: FetchPolicy = FetchPolicy(), always_whole: tuple[torch.nn.Module, ...] = ()):
        """``always_whole``: modules fetched whole whatever :meth:`fetch_whole` is given later (those whose
        forward reads their children's weights without calling them)."""
        self.units = units
        self.fetcher = Fetcher(units, policy)
        self._trainable_unit = {(id(u.buffer), u.bucket.index): i for i, u in enumerate(units) if u.trainable}
        self.handles = []
        self._unit_of_param = unit_of_param
        self._name_of = {id(m): name for name, m in module.named_modules()}  # this model's modules
        self._active: dict[int, list[tuple[int, ...]]] = defaultdict(list)  # units fetched per running call
        self._frozen_pending: dict[int, int] = defaultdict(int)  # frozen unit -> calls whose backward is to come
        self._root = module
        self._begin_handle = module.register_forward_pre_hook(self._begin_pass, prepend=True)
        self._always_whole = frozenset(id(m) for m in always_whole)
        self._wire(self._always_whole)
        _LIVE.add(self)
        watch_registrations(self)

    def _wire(self, fetch_roots: frozenset[int]) -> None:
        """Hook the modules that fetch. Each module's parameters are fetched by its *host*: itself; for a
        container (which never runs forward: a ParameterList's parameters are used by the nearest ancestor
        that runs) that ancestor; and inside a *fetch root* (a block compiled as one, see
        :meth:`fetch_whole`) the outermost root, whose hooks fetch its whole subtree at once."""
        modules = dict(self._root.named_modules())
        self._host_of: dict[int, str] = {}
        self._subtree: dict[str, list[torch.nn.Module]] = defaultdict(list)
        owned_by: dict[str, set[int]] = defaultdict(set)
        registered_by: dict[str, list] = defaultdict(list)
        for name, m in modules.items():
            host = name
            while host and isinstance(modules[host], _CONTAINERS):
                host = host.rpartition(".")[0]
            parts = name.split(".") if name else []
            for depth in range(1, len(parts) + 1):  # the outermost fetch root above (or at) this module
                prefix = ".".join(parts[:depth])
                if id(modules[prefix]) in fetch_roots:
                    host = prefix
                    break
            self._host_of[id(m)] = host
            self._subtree[host].append(m)
            owned_by[host] |= {self._unit_of_param[id(p)] for p in m._parameters.values()
                               if p is not None and id(p) in self._unit_of_param}
            registered_by[host] += [(m, key, p) for key, p in self._registered(m)]
        self._hooked: set[int] = set()
        self._unhooked = []  # (label, registered parameters) of hosts with only persistent ones
        for name, m in modules.items():
            if name in owned_by and self._host_of[id(m)] == name:
                owned = tuple(sorted(u for u in owned_by[name] if not self.units[u].persistent))
                if owned or any(external_parameters(sub) for sub in self._subtree[name]):
                    self._attach(m, name, owned, tuple(registered_by[name]))
                elif registered_by[name]:
                    self._unhooked.append((name or type(m).__name__, tuple(registered_by[name])))
        self.handles.insert(0, self._begin_handle)
        if self._root._forward_pre_hooks and self._begin_handle.id in self._root._forward_pre_hooks:
            self._root._forward_pre_hooks.move_to_end(self._begin_handle.id, last=False)

    def fetch_whole(self, blocks: list[torch.nn.Module]) -> None:
        """Fetch each of ``blocks`` (modules of this model) as one: its hooks gather every parameter of its
        subtree before it runs and free them after; the modules inside run without hooks. What compiling a
        block needs (torch.compile traces the block's forward, which must not reach into Python hooks that
        gather and free), and what FSDP2 does per ``fully_shard``ed block. Between passes only."""
        if any(self._active.values()):
            raise RuntimeError("stage 3 can regroup its fetches only between training steps")
        unknown = [type(b).__name__ for b in blocks if id(b) not in self._name_of]
        if unknown:
            raise ValueError(f"not modules of this model: {unknown}")
        self.fetcher.forget_order()  # the fetch events are the blocks' now: record the order again
        for handle in self.handles:
            if handle is not self._begin_handle:
                handle.remove()
        self.handles = []
        self._wire(frozenset(id(b) for b in blocks) | self._always_whole)

    def remove(self) -> None:
        """Take every hook off the model (engine.destroy()); what is gathered is released first."""
        self.release_all()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        _LIVE.discard(self)
        unwatch_registrations(self)

    def _attach(self, m: torch.nn.Module, name: str, owned: tuple[int, ...], registered: tuple) -> None:
        label = name or type(m).__name__
        self._hooked.add(id(m))
        # The parameters the engine partitioned, as registered on the modules this one fetches for
        # (module, key, parameter): one swapped for a new object (load_state_dict(assign=True), setattr)
        # would train nowhere, so its use is refused.
        # Ours run around the user's hooks: the gather before every forward pre-hook (prepend), the release
        # after every forward hook (moved last on each call, see _pre_forward), so a hook that reads the
        # module's weights, registered before or after initialize, finds them gathered.
        post = m.register_forward_hook(self._post_forward(label))
        self.handles.append(m.register_forward_pre_hook(self._pre_forward(label, owned, registered, post.id),
                                                        prepend=True))
        self.handles.append(post)
        if m is self._root:  # the pass begins before the root's gather
            m._forward_pre_hooks.move_to_end(self._begin_handle.id, last=False)

    def _registered(self, m: torch.nn.Module) -> tuple:
        return tuple((key, p) for key, p in m._parameters.items() if p is not None and id(p) in self._unit_of_param)

    def _check_not_swapped(self, label: str, registered) -> None:
        """A parameter the engine partitioned, replaced in its slot by a Parameter the engine does not know, would
        train nowhere. A slot emptied (parametrize moves the object), holding another known parameter (a
        rename) or a plain tensor (torch.func.functional_call, for one call) is fine."""
        for module, key, p in registered:
            now = module._parameters.get(key)
            if now is p or not isinstance(now, torch.nn.Parameter) or id(now) in self._unit_of_param:
                continue
            owner = self._name_of.get(id(module), label)
            raise PartitionedParameterError(
                f"{owner + '.' if owner else ''}{key} was replaced by a new Parameter after initialize() (e.g. "
                "load_state_dict(assign=True), module.weight = nn.Parameter(...), or torch.nn.utils."
                "parametrizations.weight_norm, which makes new parameters): ZeRO stage 3 trains the parameters "
                "it partitioned, so the new one would never be updated. Load values into the existing "
                "parameters instead (load_state_dict without assign, inside `with zeroengine.zero."
                "GatheredParameters(list(model.parameters()), modifier_rank=0)`), or make such changes "
                "before initialize()")

    def _check_unhooked(self) -> None:
        """The same check for modules whose parameters all stay gathered (persistent): they have no hooks."""
        for label, registered in self._unhooked:
            self._check_not_swapped(label, registered)

    def external_registered(self, m: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
        """``register_external_parameter(m, parameter)`` was called after this object was built."""
        if id(m) not in self._name_of:
            if id(parameter) in self._unit_of_param:
                raise ValueError(f"register_external_parameter: the {type(m).__name__} given is not a module of the "
                                 "model this parameter belongs to, so it never runs inside that model's forward; "
                                 "pass the module (of engine.module) whose forward uses the parameter")
            return
        host = self._host_of[id(m)]
        hosting = dict(self._root.named_modules())[host]
        if id(hosting) not in self._hooked:
            self._attach(hosting, host, (), ())

    def _units_of(self, m: torch.nn.Module, owned: tuple[int, ...]) -> tuple[int, ...]:
        """The units ``m`` needs: its own and the registered external parameters of the modules it fetches for
        (persistent ones excepted)."""
        external = [p for sub in self._subtree[self._host_of[id(m)]] for p in external_parameters(sub)]
        if not external:
            return owned
        extra = {self._unit_of_param[id(p)] for p in external if id(p) in self._unit_of_param}
        return tuple(sorted(set(owned) | {u for u in extra if not self.units[u].persistent}))

    # -- hooks ---------------------------------------------------------------------
    def _begin_pass(self, _module, _args) -> None:
        self._check_unhooked()
        if any(self._active.values()) or self.fetcher.running_units():
            # The model's forward starts, so no module is running: these counts are left by a forward that
            # raised (its modules' post-hooks never ran). Forget them, or their units stay gathered for good
            # and count as a checkpointed segment's enclosing parameters.
            self._active.clear()
            self.fetcher.forget_uses()
            self.end_pass(completed=False)
        elif self.fetcher.trace.in_pass:
            if torch.is_grad_enabled() and self.fetcher.continue_pass():  # another forward before the backward
                return
            self.end_pass()  # a forward with no backward after it
        self.fetcher.begin_pass(torch.is_grad_enabled())

    def _pre_forward(self, label: str, owned: tuple[int, ...], registered=(), post_id=None):
        def hook(module, args):
            self._check_not_swapped(label, registered)
            hooks = module._forward_hooks
            if post_id in hooks and next(reversed(hooks)) != post_id:  # a forward hook added since: ours last
                hooks[post_id] = hooks.pop(post_id)
            units = self._units_of(module, owned)
            self._active[id(module)].append(units)
            if not units:
                return
            self.fetcher.need(FetchEvent(label, "forward", units))
            self.fetcher.acquire(units)

        return hook

    def _post_forward(self, label: str):
        def hook(module, args, output):
            stack = self._active[id(module)]
            units = stack.pop() if stack else ()
            if not units:
                return
            returned = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
            for u in units:
                unit = self.units[u]
                if any(unit.buffer.shares_memory_with(unit.bucket, t) for t in returned):
                    unit.buffer.leave_memory_to_views(unit.bucket)
            self.fetcher.release_use(units)
            if torch.is_grad_enabled():
                outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if outputs:
                    call = _FrozenHold(tuple(u for u in units if not self.units[u].trainable))
                    self._watch_backward_done(call, args)

                    def on_backward(_grads):
                        self._frozen_backward_started(call)
                        self.fetcher.need(FetchEvent(label, "backward", units))

                    register_multi_grad_hook(outputs, on_backward, mode="any")

        return hook

    # -- activation checkpointing (the fetcher holds; the hooks are asked) ------------------------
    def running_units(self) -> tuple[int, ...]:
        """Units of the modules whose forward is running now (a checkpointed segment's enclosing modules)."""
        return self.fetcher.running_units()

    def holding(self, units: tuple[int, ...]):
        return self.fetcher.holding(units)

    # -- called by the gradient store / the optimizer --------------------------------
    def on_bucket_grads_ready(self, bucket: Bucket, buffer) -> None:
        """Every gradient of ``buffer``'s ``bucket`` exists: its unit may go (a gradient store's callback)."""
        self.fetcher.bucket_grads_ready(self._trainable_unit[(id(buffer), bucket.index)])

    def _watch_backward_done(self, call: "_FrozenHold", args) -> None:
        """A call's frozen units (released by no gradient of their own) stay, once its backward has started,
        until it is over: when the gradients of its inputs that come from other nodes exist. A leaf input (a
        learned query passed in) gets its gradient whenever the module's backward first reaches it, maybe
        before its last use of the frozen weight, so leaves are not watched; with no other inputs the units
        stay until the pass ends."""
        if not call.units:
            return
        inputs = [t for t in tree_leaves(args)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        if inputs:
            register_multi_grad_hook(inputs, lambda _grads: self._frozen_backward_done(call), mode="all")

    def _frozen_backward_started(self, call: "_FrozenHold") -> None:
        if call.units and not call.started:  # counted when its backward starts: a forward nobody
            call.started = True  # backpropagates never comes back
            for u in call.units:
                self._frozen_pending[u] += 1

    def _frozen_backward_done(self, call: "_FrozenHold") -> None:
        """One call's backward is over: its frozen units go once no other call's backward still needs them
        (``m(m(x))``: the outer call finishes first, while the inner one's backward is about to use them)."""
        if not call.started:
            return  # its backward never started: it counted nothing
        call.started = False
        for u in call.units:
            self._frozen_pending[u] -= 1
            if self._frozen_pending[u] <= 0:
                del self._frozen_pending[u]
                self.fetcher.release_idle((u,))

    def end_pass(self, completed: bool = True) -> None:
        """End of backward (or a forward nobody backpropagated): anything still gathered is freed. A pass
        ``completed`` on this rank is compared with the other ranks' (see :mod:`.gather_order`); one that
        raised here is not (the others may never arrive)."""
        self._frozen_pending.clear()
        self.fetcher.end_pass(completed)

    def after_backward(self, completed: bool) -> None:
        """The optimizer's callback once a backward finished (``completed``) or raised."""
        self.end_pass(completed)

    def release_all(self) -> None:
        """Free everything without comparing the pass (engine.destroy(), a pass the gradient store abandoned)."""
        self.end_pass(completed=False)

    @property
    def trace_state(self) -> TraceState:
        return self.fetcher.trace.state


# The stage-3 hooks objects alive now: asked what a checkpointed segment's recompute must hold.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_hooks() -> list[Stage3Hooks]:
    return list(_LIVE)


def _hold_enclosing_parameters():
    """For a checkpointed segment's forward: what holds its enclosing modules' parameters during a recompute."""
    held = [(hooks, units) for hooks in live_hooks() if (units := hooks.running_units())]
    if not held:
        return None

    @contextlib.contextmanager
    def holding_all():
        with contextlib.ExitStack() as stack:
            for hooks, units in held:
                stack.enter_context(hooks.holding(units))
            yield

    return holding_all


register_recompute_context(_hold_enclosing_parameters)
