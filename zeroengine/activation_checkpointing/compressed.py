"""Compressed saved activations (the Gist idea): what autograd keeps between forward and backward, stored smaller.

    with compress_saved_activations(torch.bfloat16) as c:   # opt-in; nothing changes outside the block
        loss = model(x).loss
    loss.backward()                                          # backward may run inside or outside the block
    c.stats                                                  # CompressionStats(count, original_bytes, ...)

    use_bit_mask_relu(model)                                 # nn.ReLU modules keep 1 bit per element

Between forward and backward, the tensors autograd saves (each op's inputs or outputs that its derivative needs)
are most of a training step's memory at long sequences. Backward only multiplies by them, so a rounding of a few
parts in a thousand changes each gradient by about as much, while the forward (which never reads the stored
copies) is unchanged bit for bit. Inside the context, every floating-point tensor that autograd saves and that is

* an activation: it requires grad (the notes on tensors outside the graph and on weights say why) and is not a
  parameter, a view of one, a leaf that requires grad, or autocast's cast of one,
* wider than ``dtype`` (fp32 for the 16-bit targets; fp32, fp16 or bf16 for fp8),
* at least ``min_bytes`` large (small ones are not worth a kernel launch each), and
* a plain tensor (not a subclass such as DTensor), strided,

is kept as a ``dtype`` copy and cast back to its own dtype when backward unpacks it. Everything else passes
through untouched. fp8 (``torch.float8_e4m3fn``: 3 mantissa bits, largest value 448) keeps one fp32 scale per
tensor, amax / 448, so the tensor's largest value lands on fp8's largest and nothing overflows; values below
about amax / 448 / 2^9 become zero. fp16 keeps no scale: values beyond 65504 become inf, which is why bf16
(fp32's exponent range) is the default.

Note on tensors outside the graph (``requires_grad`` False). They are of two kinds, and neither should be rounded.
Inputs (the batch, a frozen model's output, rotary tables, masks) are usually alive for the whole step anyway, so a
copy would add memory. And non-differentiable outputs that an op keeps for its own backward can be sensitive:
attention's logsumexp (sdpa and flash attention save it, [batch, heads, seq]) is exponentiated in backward
(P = exp(S - lse)), which multiplies its rounding error by |lse|, about ln(seq). In a 4-layer Llama at sequence 512,
rounding it too made the bf16 gradient error 3.6x larger (6.4e-3 against 1.8e-3 of the gradient's norm), for
0.07% of the bytes. The cost of the rule: what a custom ``autograd.Function`` computes inside its forward (under
no_grad) and saves is kept as it is.

Note on weights. A weight is alive for the whole step anyway, so a compressed copy of it would add
memory instead of saving it, and backward would pair the exact upstream gradient with a rounded weight in the
input gradient: the loss is then no longer exactly "activations rounded". Linear layers save the weight as a
transposed view (``W.t()``), whose ``_base`` is the parameter; that is what the check follows.

Note on sharing. One tensor is often saved by several ops: the input of the q, k and v projections, a ReLU's
output saved by the ReLU and by the next matmul. Compressing each save separately would store several copies
(two bf16 copies of one tensor cost as much as the fp32 original), and the saves are often different views: a
Linear on a [batch, seq, hidden] input saves a [batch * seq, hidden] view of it, RMSNorm's weight product the
tensor itself, and attention saves its output as a [batch, heads, seq, head_dim] view of the buffer whose
[batch * seq, hidden] view the output projection saves. Within one activation of the context, saves that cover
the same range of the same storage without gaps (offset and count: any shape, any order of dimensions) at the
same version share one flat copy, each getting its own shape and strides back; other saves share when storage,
offset, shape and strides agree. The table holds the copies weakly (a copy lives as long as some
graph node holds it) and each entry checks that the original storage is still alive, so a new tensor that the
allocator places at a freed tensor's address is never mistaken for it.

Nesting: saved-tensor hooks do not stack; the innermost context decides (inside a non-reentrant checkpoint, the
checkpoint's own hooks). A reentrant checkpoint saves only its inputs, which are then compressed, and its
recompute in backward starts from the rounded inputs. Double backward (``create_graph=True``) through compressed
tensors is not supported: the restored copies carry no graph.

``relu_with_bit_mask`` is the other half of Gist: ReLU's derivative needs only which elements were positive, 1 bit
instead of 32. It saves memory only where nothing else keeps the ReLU's output: in ``Linear -> ReLU -> Linear`` the
second matmul saves that same output for its weight gradient (and ``ReLU(gate) * up`` saves it for ``up``'s
gradient), so the mask then adds 1/32 instead of saving anything. What it always gives is an exact mask where the
saved output is compressed: under fp8, small positive outputs round to zero and would stop their gradient (in the
benchmark's ReLU Llama that changed the gradient error too little to see: docs/long-context.md).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass
class CompressionStats:
    """What one activation of the context compressed: distinct tensors (a tensor saved by several ops counts once),
    their bytes before and after (after includes fp8's 4-byte scales), and how many saves shared a copy."""

    count: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0
    shared: int = 0

    @property
    def saved_bytes(self) -> int:
        return self.original_bytes - self.stored_bytes


class _Compressed:
    """One stored copy, shared by every save of the same elements (flat, in memory order, when they were dense). ``source`` (a
    weak reference to the original's storage) tells a later save whether it is the same tensor or a new one at a
    reused address."""

    __slots__ = ("payload", "scale", "dtype", "source", "__weakref__")

    def __init__(self, payload: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, source):
        self.payload, self.scale, self.dtype, self.source = payload, scale, dtype, source

    def restore(self) -> torch.Tensor:
        if self.scale is None:
            return self.payload.to(self.dtype)
        return self.payload.float().mul_(self.scale).to(self.dtype)  # fp8 holds 3 bits: fp32 loses nothing


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` fills ``storage[offset : offset + numel]`` exactly, in some order of its dimensions
    (contiguous, transposed, permuted): then its elements are that flat range, whatever its shape."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, a view of one, a leaf that requires grad, or autocast's cast of a weight (its grad_fn is a
    copy whose only input is the weight's gradient accumulator)."""
    root = t if t._base is None else t._base
    if isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad):
        return True
    fn = root.grad_fn  # a view (Linear's W.t()) of the cast copy: look at the copy itself
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        inputs = fn.next_functions
        return len(inputs) == 1 and type(inputs[0][0]).__name__ == "AccumulateGrad"
    return False


class compress_saved_activations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors kept in ``dtype`` (bf16, fp16 or fp8 e4m3) between forward and backward; see the module
    docstring for which tensors. Lower case like ``torch.no_grad``: it is used as a context. Each ``with`` starts
    fresh statistics (``.stats``) and a fresh sharing table; an instance may be reused across steps."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, min_bytes: int = 4096):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"compress_saved_activations: dtype must be one of "
                             f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}, got {dtype!r}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"compress_saved_activations: min_bytes must be an int >= 0, got {min_bytes!r}")
        super().__init__(self._pack, self._unpack)
        self.dtype, self.min_bytes = dtype, min_bytes
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        self.stats = CompressionStats()
        self._copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._active = False

    def __enter__(self):
        if self._active:
            raise RuntimeError("compress_saved_activations: this instance is already active (nested `with`)")
        self._active = True
        self.stats = CompressionStats()
        self._copies = weakref.WeakValueDictionary()
        super().__enter__()
        return self

    def __exit__(self, *exc):
        self._active = False
        self._copies = weakref.WeakValueDictionary()  # copies stay alive through the graph; the table is done
        return super().__exit__(*exc)

    def _compressible(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.requires_grad and t.layout == torch.strided and t.is_floating_point()
                and t.device.type != "meta" and t.element_size() > self._itemsize
                and t.numel() * t.element_size() >= self.min_bytes and not _is_weight(t))

    def _pack(self, t: torch.Tensor):
        if not self._compressible(t):
            return t
        storage = t.untyped_storage()
        dense = _dense(t)
        layout = (t.numel(),) if dense else (tuple(t.shape), t.stride())
        key = (storage.data_ptr(), t.storage_offset(), layout, t.dtype, t._version)
        view = (tuple(t.shape), t.stride()) if dense else None  # how this save reads the shared flat copy
        found = self._copies.get(key)
        if found is not None and found.source() is storage:  # same live elements saved again: share the copy
            self.stats.shared += 1
            return found, view
        with torch.no_grad():
            data = t.detach().as_strided((t.numel(),), (1,)) if dense else t.detach()
            scale = None
            if self.dtype == torch.float8_e4m3fn:
                # amax / 448 maps the largest magnitude onto fp8's largest: no overflow. An all-zero tensor
                # keeps scale 1 (dividing by zero would make NaNs). Kept as a tensor: no host sync on GPUs.
                amax = data.abs().amax().float()
                scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
                # Divided in fp32 and clamped: a 16-bit original divided in its own precision could land just
                # above 448, which e4m3fn (no inf) would turn into NaN.
                payload = (data.float() / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(self.dtype)
            else:
                payload = data.to(self.dtype)
        entry = _Compressed(payload, scale, t.dtype, weakref.ref(storage))
        self._copies[key] = entry
        self.stats.count += 1
        self.stats.original_bytes += t.numel() * t.element_size()
        self.stats.stored_bytes += payload.numel() * payload.element_size() + (4 if scale is not None else 0)
        return entry, view

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        entry, view = packed
        out = entry.restore()
        return out if view is None else out.as_strided(*view)  # the original's shape and strides


# ---- ReLU with a 1-bit mask ------------------------------------------------------------------------------------

def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, 8 elements a byte (element i in bit i % 8 of byte i // 8); the last byte is padded
    with zeros. torch has no packbits; this is one shift and one sum over a [n/8, 8] view."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8).to(torch.uint8) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The bool tensor of ``shape`` that :func:`pack_bits` packed."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:shape.numel()].view(shape).bool()


class BitMaskReLU(torch.autograd.Function):
    """relu, saving for backward only which elements were positive, 1 bit each (torch.relu saves its fp32 output).
    Gradients are those of torch.relu bit for bit: both pass the gradient where the output is > 0 and put 0
    elsewhere (a ``where``, not a multiply, so an inf or NaN gradient at a masked element gives 0 as relu's does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        ctx.save_for_backward(pack_bits(x > 0))
        return torch.relu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (packed,) = ctx.saved_tensors
        return torch.where(unpack_bits(packed, ctx.shape), grad, grad.new_zeros(()))


def relu_with_bit_mask(x: torch.Tensor) -> torch.Tensor:
    return BitMaskReLU.apply(x)


class BitMaskReLUModule(nn.ReLU):
    """``nn.ReLU`` whose backward keeps a bit mask. Still an ``nn.ReLU`` for code that checks the type. Always out
    of place (``inplace=True`` is ignored): its output is a new tensor, one more for a moment than an in-place relu;
    the input is freed right after when nothing else saved it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BitMaskReLU.apply(x)


def use_bit_mask_relu(model: nn.Module) -> int:
    """Replace every ``nn.ReLU`` submodule of ``model`` by a :class:`BitMaskReLUModule`; return how many modules
    were replaced (a module shared by several parents is replaced by one shared module). Models that call
    ``F.relu`` / ``torch.relu`` directly, or use GELU / SiLU, are not affected (0 is returned for them)."""
    replaced: dict[int, BitMaskReLUModule] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.ReLU:
                replaced.setdefault(id(child), BitMaskReLUModule())
                setattr(parent, name, replaced[id(child)])
    return len(replaced)
