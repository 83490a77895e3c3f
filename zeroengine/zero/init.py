"""``zeroengine.zero.Init``: build a model with its parameters partitioned from the start.

Note: how construction is intercepted, and why the values equal an ordinary build.
Inside ``with Init():`` two hooks are active, both torch-provided and both
removed on exit (nothing in torch is replaced):

* a global *parameter-registration hook* sees every ``nn.Parameter`` a module
  registers; the parameter keeps its full value only while it is the
  *active* one, and is cut to this rank's flat slice (``ceil(numel / N)``
  elements) as soon as another parameter is touched;
* a ``TorchFunctionMode`` sees every torch function applied to a partitioned
  parameter (``reset_parameters``, ``nn.init.*``, a model's own init loop).
  Metadata (shape, numel, dim) answers for the full parameter. Any other op
  makes the parameter active again: an op that overwrites every element
  (``normal_``, ``uniform_``, ``zero_``, ``fill_``, ``copy_``, ...) starts
  from an uninitialised full tensor, any other op (``erfinv_``, ``mul_``,
  ``__getitem__``) from the full value, all-gathered from the ranks' slices.

Where the slices live: on the device the model is built on, unless
``remote_device="cpu"`` (or the config's ``offload_param``) keeps them in CPU
memory, pinned with ``pin_memory``, as DeepSpeed's ``remote_device`` does. A
model built on the GPU then holds only one full parameter there at a time, and
its fp32 values, kept until ``initialize()`` cuts the fp32 masters from them,
never occupy GPU memory as a whole (what lets a model larger than the GPU's
memory be built for optimizer and parameter offload).

Every rank runs the same construction code with the same seed, and every
op runs on a full-size tensor exactly as in an ordinary build, so the random
number generator is consumed identically and each rank keeps its slice of
exactly the values an ordinary build would produce. At most one parameter is
whole at any time: the peak is about Ψ/N plus the largest parameter.

``initialize()`` then re-cuts these per-parameter slices into the engine's
bucket layout (one parameter at a time, see :class:`InitReshard`). Until then
a partitioned parameter raises on use (see :mod:`zeroengine.zero.param_guard`);
``GatheredParameters`` gives its full value (e.g. to load pretrained weights).
"""
from __future__ import annotations

import weakref

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode

from zeroengine import comm

from .param_guard import FULL_METADATA, PASS_THROUGH, info_of, mark_gathered, mark_partitioned, op_arguments, op_name

# In-place ops that write every element without reading any: no gather needed to run them.
_OVERWRITE = frozenset({"normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "exponential_",
                        "log_normal_", "cauchy_", "geometric_", "bernoulli_", "set_"})


class InitShard:
    """This rank's flat slice of one parameter built under Init (kept on ``device``, default: the
    parameter's own; with ``swap``, remote_device "nvme", in a region of its file instead)."""

    def __init__(self, flat: torch.Tensor, rank: int, world: int, group, device: torch.device | None = None,
                 pin_memory: bool = False, swap=None):
        self.numel = flat.numel()
        self.rank, self.world, self.group = rank, world, group
        self.chunk = -(-self.numel // world)
        self.compute_device = flat.device  # where the full value is built and gathered
        self.home = device  # remote_device: the slice stays there whatever device the model moves to
        self.pin = pin_memory and device is not None and device.type == "cpu" and torch.cuda.is_available()
        self.swap = swap
        self.region = None  # (offset, dtype, numel) in the swap file
        if swap is None:
            self.shard = torch.zeros(self.chunk, dtype=flat.dtype, device=flat.device if device is None else device,
                                     pin_memory=self.pin)
        self.set_own(flat)  # (on the drive: writes the slice, and leaves an empty shard in memory)

    @property
    def dtype(self) -> torch.dtype:
        return self.region[1] if self.region is not None else self.shard.dtype

    @property
    def nbytes(self) -> int:
        """Host (or device) bytes the slice holds: none when it is on the drive."""
        return 0 if self.swap is not None else self.shard.numel() * self.shard.element_size()

    def own_values(self) -> torch.Tensor:
        """The slice (``chunk`` elements, the tail past the parameter's end zero)."""
        return self.swap.read(self.region) if self.swap is not None else self.shard

    def set_own(self, flat: torch.Tensor) -> None:
        """Keep this rank's slice of the full flat value ``flat``."""
        lo, hi = min(self.rank * self.chunk, self.numel), min((self.rank + 1) * self.chunk, self.numel)
        if self.swap is None:
            self.shard[:hi - lo].copy_(flat[lo:hi])
            return
        values = torch.zeros(self.chunk, dtype=flat.dtype)
        values[:hi - lo].copy_(flat[lo:hi])
        if self.region is not None and self.region[1] == values.dtype:
            self.swap.rewrite(self.region, values)
        else:
            self.region = self.swap.write(values)
        self.shard = torch.empty(0, dtype=flat.dtype)  # nothing in memory: the file has it

    def full_flat(self) -> torch.Tensor:
        """The parameter's full flat value (collective: every rank calls it for the same parameter)."""
        full = torch.empty(self.chunk * self.world, dtype=self.dtype, device=self.compute_device)
        own = self.own_values()
        own = own.to(self.compute_device, non_blocking=own.is_pinned())
        comm.all_gather(full, own, group=self.group)
        return full[:self.numel]

    def convert(self, param, func, args, kwargs):
        """``module.to(...)`` before initialize(): convert this slice alongside the (empty) placeholder; with
        a remote device only its dtype changes, and the full values are built and gathered where the
        placeholder went."""
        with torch._C.DisableTorchFunction():
            placeholder = func(param, *args, **kwargs)
            if self.swap is not None:  # on the drive: a new region in the new dtype
                values = func(self.own_values(), *args, **kwargs).to("cpu")
                self.region = self.swap.write(values)
                self.compute_device = placeholder.device
                return placeholder
            shard = func(self.shard, *args, **kwargs)
            if self.home is not None and shard.device != self.home:
                shard = shard.to(self.home)
                shard = shard.pin_memory() if self.pin else shard
            self.shard, self.compute_device = shard, placeholder.device
            return placeholder


class _InitState:
    """The context's bookkeeping: the active parameter and the bytes held."""

    def __init__(self, rank: int, world: int, group, remote_device: torch.device | None = None,
                 pin_memory: bool = False, swap=None):
        self.rank, self.world, self.group = rank, world, group
        self.remote_device, self.pin_memory = remote_device, pin_memory
        self.swap = swap  # remote_device "nvme": the file the slices go to
        self.active: torch.nn.Parameter | None = None
        self.held_bytes = 0  # slices of every live partitioned parameter + the active full value
        self.peak_bytes = 0
        self.partitioned = 0

    def _count(self, delta: int) -> None:
        self.held_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def activate(self, p: torch.nn.Parameter, read_values: bool) -> None:
        """Give ``p`` its full value (all-gathered when the op reads it)."""
        if self.active is p:
            return
        self.flush()
        info = info_of(p)
        shard = info.init_shard
        with torch._C.DisableTorchFunction():
            full = shard.full_flat() if read_values else torch.empty(shard.numel, dtype=shard.dtype,
                                                                     device=shard.compute_device)
            p.data = full.view(info.shape)
        mark_gathered(p)
        self.active = p
        self._count(full.numel() * full.element_size())

    def adopt(self, p: torch.nn.Parameter, name: str) -> None:
        """A newly registered parameter: it is the active one (its values are whole right now)."""
        self.flush()
        with torch._C.DisableTorchFunction():
            flat = p.detach().reshape(-1)
            shard = InitShard(flat, self.rank, self.world, self.group, self.remote_device, self.pin_memory,
                              self.swap)
        mark_partitioned(p, name, p.shape)
        mark_gathered(p)
        info_of(p).init_shard = shard
        self._count(shard.nbytes + flat.numel() * flat.element_size())
        weakref.finalize(p, self._count, -shard.nbytes)
        self.active = p
        self.partitioned += 1

    def flush(self) -> None:
        """Cut the active parameter back to its slice."""
        p = self.active
        if p is None:
            return
        info = info_of(p)
        shard = info.init_shard
        with torch._C.DisableTorchFunction():
            flat = p.detach().reshape(-1)
            shard.set_own(flat)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        mark_partitioned(p)
        self.active = None
        nbytes = flat.numel() * flat.element_size()
        del flat
        self._count(-nbytes)
        if nbytes >= _TRIM_ABOVE and (p.device.type == "cpu" or shard.swap is not None
                                      or shard.shard.device.type == "cpu"):
            _return_free_heap()


# Note: returning freed full values to the OS.
# glibc keeps freed memory in its heap; the next full parameter is a fresh
# allocation while the slices kept in between fragment the holes, so without
# help the process's resident memory would grow by about one full parameter per
# parameter built, exactly what Init is meant to avoid (measured: 116 MiB of
# RSS growth for a 48 MiB model on 2 ranks, 28 MiB after trimming). So after a
# large full value is dropped, free heap pages go back to the OS (malloc_trim;
# a few ms, once per large parameter, only while building).
_TRIM_ABOVE = 1 << 20
_trim = None


def _return_free_heap() -> None:
    global _trim
    if _trim is None:
        try:
            import ctypes

            _trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _trim = False
    if _trim:
        _trim(0)


def _partitioned_args(args, kwargs):
    return [a for a in op_arguments(args, kwargs)
            if isinstance(a, torch.nn.Parameter) and getattr(info_of(a), "init_shard", None) is not None]


class _InitMode(TorchFunctionMode):
    def __init__(self, state: _InitState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        targets = [p for p in _partitioned_args(args, kwargs) if p is not self.state.active]
        if not targets:
            return func(*args, **kwargs)
        name = op_name(func)
        # torch.nn.init's functions hand their tensor over by keyword (``tensor=``), everything else by position
        first = args[0] if args else kwargs.get("tensor")
        if first is targets[0]:
            answer = FULL_METADATA.get(name)
            if answer is not None:
                return answer(info_of(first), *args[1:], **kwargs)
            if name == "data.__get__":
                # p.data.normal_(), p.data.zero_(), p.data[0].fill_(...): what follows is not seen (it runs on
                # a plain alias, not on p), so p gets its full values now and .data is the usual detached
                # alias of them; the edit lands in the full value, which is cut back to the slice later.
                self.state.activate(first, read_values=True)
                return func(*args, **kwargs)
        if name in PASS_THROUGH:
            return func(*args, **kwargs)
        if len(targets) > 1:
            raise NotImplementedError(f"zero.Init: '{name}' uses several partitioned parameters at once "
                                      f"({', '.join(info_of(t).name for t in targets)}); build them outside "
                                      "Init or combine them after initialize()")
        # torch.nn.init's functions (kaiming_uniform_, normal_, orthogonal_, ...) each overwrite the whole
        # tensor: it becomes active without its old values and the function runs on it as usual.
        overwrite = first is targets[0] and (name in _OVERWRITE or getattr(func, "__module__", "") == "torch.nn.init")
        self.state.activate(targets[0], read_values=not overwrite)
        return func(*args, **kwargs)


class Init:
    """Context manager: modules built inside have their parameters partitioned at construction.

    ``config`` (path, dict or parsed config) is optional; when it names a ZeRO
    stage other than 3, or ``enabled`` is False, nothing is partitioned.
    ``remote_device`` ("cpu", or None: the device each parameter is built on;
    default "cpu" when the config offloads parameters) is where the slices
    live until ``initialize()``; ``pin_memory`` pins them there.
    Every rank must build the same modules in the same order, with the same
    seed (a collective may run when an init op reads a parameter's values).

    DeepSpeed's other arguments: ``module`` partitions a model built before, at once (no ``with`` needed: the
    call does it, and a model may be passed as the first argument, DeepSpeed's position for it); ``dtype``
    casts the floating-point parameters and buffers built inside (or of ``module``) to it (None: they keep the
    dtype they are built in; DeepSpeed then takes the config's fp16/bf16 dtype); ``mpu`` (a Megatron-style
    model-parallel unit): without ``data_parallel_group``, its data-parallel group is the one partitioned
    over, the ranks that hold the same parameters (DeepSpeed partitions over the world unless told, which
    mixes tensor-parallel slices); ``mem_efficient_linear`` changes nothing (no function is replaced).
    """

    _depth = 0

    def __init__(self, config=None, enabled: bool = True, data_parallel_group=None, config_dict_or_path=None,
                 remote_device: str | None = None, pin_memory: bool = False, *, module=None, dtype=None,
                 mpu=None, mem_efficient_linear: bool = True):
        del mem_efficient_linear  # DeepSpeed's replacement of F.linear; zeroengine replaces no function
        if isinstance(config, torch.nn.Module) and module is None:  # DeepSpeed's first positional argument
            config, module = None, config
        # config_dict_or_path: DeepSpeed's name for ``config``
        stage, offload = _zero_settings(config if config is not None else config_dict_or_path)
        self.enabled = enabled and stage in (None, 3)
        self.offload = offload  # the config's offload_param block (None: no parameter offload)
        self.remote_device = _remote_device(remote_device, offload if self.enabled else None)
        self.pin_memory = bool(pin_memory)
        self.group = data_parallel_group if data_parallel_group is not None else _mpu_data_group(mpu)
        self.dtype = _float_dtype(dtype)
        self.state: _InitState | None = None
        self._handle = None
        self._mode = None
        if module is not None:
            self.partition_module(module)

    @property
    def peak_bytes(self) -> int:
        """Largest number of parameter bytes held at once while building (slices + the active value)."""
        return self.state.peak_bytes if self.state is not None else 0

    def __enter__(self):
        if not self.enabled or Init._depth > 0:
            Init._depth += 1
            self._nested = True
            return self
        self._nested = False
        Init._depth += 1
        self.state = self._new_state()
        self._handle = register_module_parameter_registration_hook(self._on_register)
        self._buffer_handle = register_module_buffer_registration_hook(self._on_buffer) if self.dtype else None
        # Which modules became another's child, to name each parameter by its full path at exit.
        self._owners: list = []
        self._parents: dict[int, weakref.ref] = {}
        self._child_handle = register_module_module_registration_hook(self._on_child)
        self._mode = _InitMode(self.state)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        Init._depth -= 1
        if self._nested:
            return False
        try:
            self.state.flush()
        finally:
            self._mode.__exit__(exc_type, exc, tb)
            self._handle.remove()
            self._child_handle.remove()
            if self._buffer_handle is not None:
                self._buffer_handle.remove()
        if exc_type is None:
            try:
                self._name_by_full_path()
            except Exception:  # noqa: BLE001 - names for error messages only: never fail a build over them
                pass
        self._owners, self._parents = [], {}
        return False

    def _on_register(self, module, name, param):
        if param is None or getattr(info_of(param), "init_shard", None) is not None:
            return None  # tied: already partitioned under its first owner
        if not param.is_floating_point():
            return None  # an integer table (ids, indices) stays whole, as stage 3 keeps it (stage3.split_params)
        self._cast(param)
        self.state.adopt(param, name)
        self._owners.append(weakref.ref(module))
        return None

    def _on_buffer(self, module, name, buffer):
        if buffer is not None and buffer.is_floating_point() and buffer.dtype != self.dtype:
            return buffer.to(self.dtype)  # (the hook's return value is what the module registers)
        return None

    def _cast(self, param: torch.nn.Parameter) -> None:
        if self.dtype is not None and param.dtype != self.dtype:
            with torch._C.DisableTorchFunction():
                param.data = param.data.to(self.dtype)

    def _new_state(self) -> _InitState:
        comm.init_distributed()
        swap = None
        if self.remote_device == NVME:  # the slices go to a file under offload_param.nvme_path
            from zeroengine.offload.nvme.init_swap import AppendSwap

            swap = AppendSwap(self.offload.nvme_path, self.offload.aio.handle_args())
        return _InitState(comm.get_rank_in(self.group), comm.get_world_size(self.group), self.group,
                          torch.device("cpu") if swap is not None else self.remote_device, self.pin_memory, swap)

    def partition_module(self, module: torch.nn.Module) -> None:
        """Partition the parameters of ``module``, built outside Init, as if it had been built inside
        (DeepSpeed's ``zero.Init(module=...)``); collective: every rank passes the same model. Parameters
        already partitioned are left as they are; with Init disabled nothing changes."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"zero.Init(module=...): expected an nn.Module, got {type(module).__name__}")
        if not self.enabled:
            return
        state = self.state if self.state is not None else self._new_state()
        if self.dtype is not None:
            for sub in module.modules():
                for key, buffer in list(sub.named_buffers(recurse=False)):
                    if buffer.is_floating_point():
                        setattr(sub, key, buffer.to(self.dtype))  # (stays a buffer, persistent or not)
        for name, param in module.named_parameters():
            if is_init_partitioned(param) or not param.is_floating_point():
                continue
            self._cast(param)
            state.adopt(param, name)
            state.flush()
        if self.state is None:
            self.state = state

    def _on_child(self, parent, _name, child):
        if child is not None:
            self._parents.setdefault(id(child), weakref.ref(parent))
        return None

    def _name_by_full_path(self) -> None:
        """Name the parameters built here by their path in the outermost module built here ("blocks.0.attn.
        qkv.weight", not "weight"), so errors before initialize() say which one."""
        roots, seen = [], set()
        for ref in self._owners:
            m = ref()
            while m is not None and id(m) in self._parents:  # climb to the outermost module built here
                m = self._parents[id(m)]()
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                roots.append(m)
        named = set()
        for root in roots:
            for full_name, p in root.named_parameters():  # (a tied parameter: its first owner's path)
                info = info_of(p)
                if info is not None and getattr(info, "init_shard", None) is not None and id(p) not in named:
                    named.add(id(p))
                    info.name = full_name


def _mpu_data_group(mpu):
    """The data-parallel group of a Megatron-style ``mpu`` (None without one: the world)."""
    if mpu is None:
        return None
    getter = getattr(mpu, "get_data_parallel_group", None)
    if not callable(getter):
        raise TypeError("zero.Init(mpu=...): the mpu lacks get_data_parallel_group(), the ranks that hold the "
                        "same parameters and partition them; pass data_parallel_group instead")
    return getter()


def _float_dtype(dtype) -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"zero.Init(dtype={dtype!r}): expected a floating-point torch.dtype (torch.float32, "
                         "torch.bfloat16, torch.float16) or None")
    return dtype


NVME = "nvme"  # remote_device: the slices go to a swap file


def _remote_device(remote_device, offload) -> torch.device | str | None:
    """DeepSpeed's ``remote_device``: "cpu" keeps the slices in CPU memory, "nvme" in a file under the config's
    ``offload_param.nvme_path``; None or "none" leaves them where the parameter is built, unless the config
    offloads parameters (``offload``: its offload_param block), then they go where it offloads them, as
    DeepSpeed does."""
    if remote_device in (None, "none"):
        if offload is None:
            return None
        return NVME if offload.device == NVME else torch.device("cpu")
    if remote_device == NVME:
        if offload is None or not offload.nvme_path:
            raise ValueError("zero.Init(remote_device='nvme') writes the slices under the config's "
                             "zero_optimization.offload_param.nvme_path: pass a config with that offload_param "
                             "block ({\"device\": \"nvme\", \"nvme_path\": ...})")
        return NVME
    if str(remote_device) != "cpu":
        raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected 'cpu', 'nvme', 'none' or None "
                         "(the slices stay on the device the model is built on)")
    return torch.device("cpu")


def _zero_settings(config):
    """(ZeRO stage, the offload_param block or None) of a config dict, parsed config or path (read once);
    (None, None) without a config."""
    if config is None:
        return None, None
    if isinstance(config, dict):  # read as given (integrations pass configs with "auto" still in them)
        zero = config.get("zero_optimization") or {}
        block = zero.get("offload_param") or {}
        if block.get("device") not in ("cpu", NVME):
            return zero.get("stage", 0), None
        from zeroengine.config.sections.aio import AioConfig
        from zeroengine.config.sections.offload import OffloadParamConfig

        offload = OffloadParamConfig.model_validate(block)
        offload._aio = AioConfig.model_validate(config.get("aio") or {})
        return zero.get("stage", 0), offload
    zero = getattr(config, "zero_optimization", None)
    if zero is None:
        from zeroengine.config import load_config

        zero = load_config(config, world_size=comm.get_world_size()).zero_optimization
    return zero.stage, zero.offload_param


def is_init_partitioned(p: torch.Tensor) -> bool:
    return getattr(info_of(p), "init_shard", None) is not None


class InitReshard:
    """Re-cuts Init's per-parameter slices into the engine's bucket layout, one parameter at a time.

    The buffer asks for its chunks bucket by bucket (:meth:`chunk`); every rank
    all-gathers every Init parameter of the bucket in layout order (so the
    collectives line up) and keeps the pieces that fall in its own chunk. In
    16-bit training the fp32 pieces are kept too, for the fp32 master chunks
    (:meth:`fp32_values` stands in for the full fp32 values the optimizer
    reads, holding only this rank's pieces).
    """

    def __init__(self, params: list[torch.nn.Parameter], rank: int, keep_fp32: bool):
        self.params = params
        self.rank = rank
        self.keep_fp32 = keep_fp32
        self._fp32_pieces: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self._spill = None  # remote_device "nvme": the fp32 pieces wait on the drive too

    def chunk(self, bucket, dtype: torch.dtype) -> torch.Tensor:
        device = comm.device_for_backend()
        chunk = torch.zeros(bucket.chunk_numel, dtype=dtype, device=device)
        own = {piece.slot.index: piece for piece in bucket.pieces_in_chunk(self.rank)}
        for slot in bucket.slots:
            p = self.params[slot.index]
            if is_init_partitioned(p):
                flat = info_of(p).init_shard.full_flat()
            else:
                flat = p.detach().reshape(-1)
            piece = own.get(slot.index)
            if piece is not None:
                value = flat[piece.param_start:piece.param_end]
                chunk[piece.chunk_start:piece.chunk_start + piece.numel].copy_(value)
                if self.keep_fp32:  # beside the Init slices (CPU memory with remote_device="cpu", or the drive)
                    self._fp32_pieces.setdefault(slot.index, {})[(piece.param_start, piece.param_end)] = \
                        self._keep(p, value.to(dtype=torch.float32))
            del flat
        return chunk

    def _keep(self, p: torch.nn.Parameter, value: torch.Tensor):
        """An fp32 piece kept until the masters are made: where the parameter's slice lives."""
        shard = info_of(p).init_shard if is_init_partitioned(p) else None
        if shard is None or shard.swap is None:
            return value.to(device=self._home_of(p), copy=True)
        if self._spill is None:
            self._spill = shard.swap.sibling("fp32_pieces.swp")
        return _OnDrive(self._spill, self._spill.write(value))

    def _home_of(self, p: torch.nn.Parameter) -> torch.device:
        shard = info_of(p).init_shard if is_init_partitioned(p) else None
        if shard is not None and shard.swap is not None:
            return torch.device("cpu")
        return shard.shard.device if shard is not None else p.device

    def release_init_shards(self) -> None:
        swaps = {}
        for p in self.params:
            info = info_of(p)
            if info is not None:
                shard = getattr(info, "init_shard", None)
                if shard is not None and shard.swap is not None:
                    swaps[id(shard.swap)] = shard.swap
                info.init_shard = None
        for swap in swaps.values():  # every slice of theirs was just let go
            swap.close()

    def fp32_values(self) -> list:
        """Call before :meth:`release_init_shards` (the pieces' device is read from the slices)."""
        return [_OwnPieces(self._fp32_pieces.setdefault(i, {}), self._home_of(p)) for i, p in enumerate(self.params)]


class _OwnPieces:
    """A full fp32 parameter value of which only this rank's pieces exist.

    ``flat_params.gather_chunk`` reads exactly ``value.detach().reshape(-1)[start:end]`` for the pieces
    in this rank's chunk; that is all this object supports.
    """

    def __init__(self, pieces: dict[tuple[int, int], torch.Tensor], device: torch.device):
        self._pieces = pieces
        self.device = device

    def detach(self):
        return self

    def reshape(self, *_shape):
        return self

    def __getitem__(self, where: slice) -> torch.Tensor:
        piece = self._pieces[(where.start, where.stop)]
        return piece.read() if isinstance(piece, _OnDrive) else piece


class _OnDrive:
    """A tensor kept in a swap file's region (read back when asked for)."""

    def __init__(self, swap, region):
        self.swap, self.region = swap, region

    def read(self) -> torch.Tensor:
        return self.swap.read(self.region)
