"""One rank of one variant's world, for ``bench_stages.py``.

A rank is a process of its own (forked from a forkserver that has imported
only torch), started with a :class:`Variant`, a :class:`RunSpec`, its rank and
a pipe to the orchestrator. It joins a 2-process gloo world made for this
variant alone; trains a throwaway tiny GPT for two steps (see
:func:`_prewarm`); records its RSS; builds the model and the variant's
training wrapper (torch DDP, a zeroengine engine or a DeepSpeed engine); runs
the warm-up steps and reports ``ready``. Then it obeys the orchestrator:

* ``("run", n)``: a barrier, then ``n`` timed training steps; replies with
  per-step wall times by phase, CPU time, page faults and the last loss;
* ``("finish", None)``: replies with its memory and communication figures
  (RSS at each stage, peak RSS, ``memory_breakdown()``, bytes communicated)
  and leaves the world.

Only the code of the variant being run is imported: a DDP rank never imports
zeroengine or DeepSpeed, and DeepSpeed is imported only in DeepSpeed ranks.
"""
from __future__ import annotations

import os
import resource
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


@dataclass(frozen=True)
class Variant:
    """What one world runs. ``kind``: ``ddp``, ``fsdp2``, ``zeroengine`` or ``deepspeed``."""

    name: str
    kind: str
    stage: int = 0
    reduce_bucket_size: int = 50_000_000
    overlap_comm: bool = False
    zero_init: bool = False  # build the model under zeroengine.zero.Init (stage 3)
    env: tuple[tuple[str, str], ...] = ()  # environment set in the ranks before anything runs


@dataclass(frozen=True)
class RunSpec:
    model: ModelShape
    micro_batch: int
    warmup_steps: int
    world_size: int
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    data_batches: int = 16  # distinct batches per rank, cycled
    seed: int = 1234
    prewarm: bool = True  # run the variant on PREWARM_MODEL first (see _prewarm)


PREWARM_MODEL = ModelShape(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


# --------------------------------------------------------------------------- memory probes


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """Peak RSS of this process: VmHWM, else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- model, data, optimizer


def build_model(shape: ModelShape, seed: int, zero_init: bool = False):
    import torch

    sys.path.insert(0, str(REPO / "examples" / "gpt"))
    from model import GPT, GPTConfig

    torch.manual_seed(seed)  # same initial weights on every rank and in every variant
    if zero_init:  # each rank keeps only its slice of every parameter from the start (same values)
        from zeroengine.zero import Init

        with Init():
            return GPT(GPTConfig(**asdict(shape)))
    return GPT(GPTConfig(**asdict(shape)))


def make_batches(spec: RunSpec, rank: int):
    """``spec.data_batches`` (x, y) pairs for this rank from the example's learnable synthetic tokens."""
    sys.path.insert(0, str(REPO / "examples" / "gpt"))
    from model import SyntheticTokens

    n = spec.micro_batch * spec.data_batches * spec.world_size
    data = SyntheticTokens(n, spec.model.block_size, spec.model.vocab_size, seed=spec.seed)
    out = []
    for i in range(spec.data_batches):
        first = (i * spec.world_size + rank) * spec.micro_batch
        seqs = data.seqs[first:first + spec.micro_batch]
        out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
    return out


def make_optimizer(params, spec: RunSpec):
    """The one optimizer every variant steps: torch AdamW with torch's defaults on CPU (no foreach/fused flag)."""
    import torch

    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


# --------------------------------------------------------------------------- the variants


class Trainer:
    """A training step for one variant, in three timed phases, plus what it can say about memory and comm."""

    def forward(self, x, y):
        return self.model(x, y)

    def backward(self, loss) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def step(self, x, y) -> float:
        loss = self.forward(x, y)
        self.backward(loss)
        self.optimizer_step()
        return float(loss.detach())

    def probe_step(self, x, y) -> dict | None:
        """The last warm-up step; a variant that can, returns its bytes held by kind, taken between
        backward and step (when gradients are held)."""
        self.step(x, y)
        return None

    def comm_start(self) -> None:
        """Start counting communication (called after warm-up)."""

    def close(self) -> None:
        """Release what a throwaway trainer registered outside itself (hooks, groups)."""

    def comm_report(self, steps: int) -> dict | None:
        return None


class DDPTrainer(Trainer):
    def __init__(self, model, spec: RunSpec, variant: Variant):
        from torch.nn.parallel import DistributedDataParallel

        self.model = DistributedDataParallel(model)  # torch defaults: 25 MiB buckets, overlapped all-reduce
        self.optimizer = make_optimizer(self.model.parameters(), spec)

    def backward(self, loss) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _EngineTrainer(Trainer):
    """zeroengine and DeepSpeed engines share DeepSpeed's loop: engine(x, y), engine.backward, engine.step."""

    engine = None

    def forward(self, x, y):
        return self.engine(x, y)

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        self.engine.step()

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()


def stage3_settings(spec: RunSpec, variant: Variant) -> dict:
    """Stage 3's fetch policy in the benchmark (elements): prefetch about two modules ahead, at most a few
    modules' worth gathered at once, keep only what is reused right away, and DeepSpeed's "auto"
    persistence (10 x hidden: the LayerNorm and bias vectors stay whole)."""
    bucket = variant.reduce_bucket_size
    largest = spec.model.vocab_size * spec.model.n_embd  # the tied embedding/head, gathered whole
    return {"stage3_prefetch_bucket_size": 2 * bucket,
            "stage3_max_live_parameters": largest + 4 * bucket,
            "stage3_max_reuse_distance": bucket,
            "stage3_param_persistence_threshold": 10 * spec.model.n_embd}


def _engine_config(spec: RunSpec, variant: Variant, **zero_extra) -> dict:
    if variant.stage == 3:
        zero_extra = {**stage3_settings(spec, variant), **zero_extra}
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": spec.micro_batch * spec.world_size,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": variant.stage, "overlap_comm": variant.overlap_comm,
                              "contiguous_gradients": True, "reduce_bucket_size": variant.reduce_bucket_size,
                              **zero_extra},
    }


class ZeroEngineTrainer(_EngineTrainer):
    def __init__(self, model, spec: RunSpec, variant: Variant):
        import zeroengine

        optimizer = make_optimizer(model.parameters(), spec)
        self.engine, _, _, _ = zeroengine.initialize(model=model, optimizer=optimizer,
                                                     config=_engine_config(spec, variant))

    def probe_step(self, x, y) -> dict | None:
        self.backward(self.forward(x, y))
        breakdown = self.engine.memory_breakdown()
        self.optimizer_step()
        return breakdown

    def comm_start(self) -> None:
        from zeroengine import comm

        comm.counters.reset()
        reset = getattr(self.engine.optimizer, "reset_fetch_stats", None)
        if reset is not None:
            reset()

    def comm_report(self, steps: int) -> dict | None:
        from zeroengine import comm

        ops = comm.counters.snapshot()
        report = {"source": "zeroengine.comm.counters",
                  "wire_bytes_per_step": sum(o["wire_bytes"] for o in ops.values()) / steps,
                  "payload_bytes_per_step": sum(o["payload_bytes"] for o in ops.values()) / steps,
                  "ops_per_step": {k: {f: v / steps for f, v in o.items()} for k, o in ops.items()}}
        fetch_stats = getattr(self.engine.optimizer, "fetch_stats", None)
        if fetch_stats is not None:  # stage 3: gathers on demand vs prefetched, live elements (since warm-up)
            report["stage3_fetch"] = fetch_stats()
        return report


class DeepSpeedTrainer(_EngineTrainer):
    def __init__(self, model, spec: RunSpec, variant: Variant):
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        config = _engine_config(spec, variant, reduce_scatter=True,
                                allgather_bucket_size=variant.reduce_bucket_size)
        # torch.optim.AdamW is on DeepSpeed's tested-with-ZeRO list; the flag only silences the check.
        config["zero_allow_untested_optimizer"] = True
        optimizer = make_optimizer(model.parameters(), spec)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                    dist_init_required=False)

    def logged_comm_step(self, x, y, world: int) -> dict:
        """Bytes of one extra step with DeepSpeed's comms logger on (it syncs and times every op, so it
        stays off while timing)."""
        import deepspeed.comm as dist
        from deepspeed.comm.comm import comms_logger

        comms_logger.comms_dict.clear()
        dist.configure(enabled=True, prof_all=True)
        self.step(x, y)
        dist.configure(enabled=False, prof_all=False)
        return deepspeed_comm_bytes(comms_logger.comms_dict, world)


def deepspeed_comm_bytes(comms_dict: dict, world: int) -> dict:
    """Bytes per step from DeepSpeed's comms-logger records ``{op: {msg_size: [count, ...]}}``.

    The logger's msg_size is the tensor argument: the per-rank input of
    all_gather_into_tensor, the full input of reduce_scatter_tensor, the
    tensor of all_reduce / reduce / broadcast. Payload is put on zeroengine's
    footing (all-gather: the full output); wire bytes use the same ring
    formulas as ``zeroengine.comm.counters``. ``reduce`` (DeepSpeed's stage 1/2
    reduce each slice of a bucket to its owner) is counted as (N-1)/N of its
    message per rank: a rank sends every slice it does not own.
    """
    share = (world - 1) / world
    ops, payload, wire = {}, 0.0, 0.0
    for name, sizes in comms_dict.items():
        count = sum(rec[0] for rec in sizes.values())
        msg = sum(size * rec[0] for size, rec in sizes.items())
        if "all_gather" in name:
            p, w = msg * world, msg * world * share
        elif "reduce_scatter" in name:
            p, w = msg, msg * share
        elif "all_reduce" in name:
            p, w = msg, 2 * msg * share
        elif name == "reduce":
            p, w = msg, msg * share
        else:
            p, w = msg, msg
        ops[name] = {"calls": count, "payload_bytes": p, "wire_bytes": w}
        payload += p
        wire += w
    return {"source": "deepspeed comms_logger, one extra untimed step", "wire_bytes_per_step": wire,
            "payload_bytes_per_step": payload, "ops_per_step": ops}


class FSDP2Trainer(Trainer):
    """torch FSDP2 (``fully_shard``): each transformer block is one sharded group, the root (embeddings,
    tied head, final norm) another; torch defaults otherwise (reshard after forward, fp32)."""

    def __init__(self, model, spec: RunSpec, variant: Variant):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        self.model = model
        self.optimizer = make_optimizer(model.parameters(), spec)

    def backward(self, loss) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


TRAINERS = {"ddp": DDPTrainer, "fsdp2": FSDP2Trainer, "zeroengine": ZeroEngineTrainer,
            "deepspeed": DeepSpeedTrainer}


# --------------------------------------------------------------------------- the rank's life


def _init_world(rank: int, world: int, port: int, variant: Variant) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    if variant.kind == "deepspeed":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))


def _import_variant_library(variant: Variant) -> None:
    """Import before the RSS baseline, so the baseline holds the library and growth is model states."""
    if variant.kind == "zeroengine":
        import zeroengine.initialization  # noqa: F401  (zeroengine itself imports lazily)
    elif variant.kind == "deepspeed":
        import deepspeed  # noqa: F401


def _usage() -> tuple[float, int]:
    """(CPU seconds of every thread of this process, minor page faults) so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_minflt


def _timed_steps(trainer: Trainer, batches, start: int, n: int) -> tuple[dict[str, list[float]], float]:
    """``n`` steps after a barrier: per step, the wall time of forward, backward, optimizer step and the
    whole; the process's CPU time (all threads: compute, copies, gloo) and its minor page faults (memory
    the allocator had to get from the OS again) over the whole step."""
    import torch.distributed as dist

    dist.barrier()
    times: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "total": [], "cpu": [],
                                     "page_faults": []}
    loss = float("nan")
    for i in range(start, start + n):
        x, y = batches[i % len(batches)]
        cpu, faults = _usage()
        t0 = time.perf_counter()
        out = trainer.forward(x, y)
        t1 = time.perf_counter()
        trainer.backward(out)
        t2 = time.perf_counter()
        trainer.optimizer_step()
        t3 = time.perf_counter()
        loss = float(out.detach())
        cpu_end, faults_end = _usage()
        for name, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, cpu_end - cpu, faults_end - faults)):
            times[name].append(value)
    return times, loss


def rank_main(variant: Variant, spec: RunSpec, rank: int, port: int, conn) -> None:
    """Entry point of one spawned rank (see module doc)."""
    try:
        _serve(variant, spec, rank, port, conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _release_free_heap() -> bool:
    """glibc's malloc_trim(0): give the allocator's free pages back to the OS; False where there is none."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def _prewarm(variant: Variant, spec: RunSpec, rank: int) -> None:
    """Train a throwaway tiny GPT with the same variant for two steps, then drop it.

    Whatever a first run costs regardless of model size (modules imported on
    first use, e.g. by DDP or engine construction, libtorch code pages faulted
    in, autograd and gloo threads, allocator arenas) is then paid before the
    "warm" RSS baseline, so the warm growth is what this model's training adds.
    """
    import gc

    tiny = RunSpec(model=PREWARM_MODEL, micro_batch=2, warmup_steps=2, world_size=spec.world_size,
                   data_batches=2, seed=spec.seed)
    trainer = TRAINERS[variant.kind](build_model(tiny.model, tiny.seed, variant.zero_init), tiny, variant)
    for x, y in make_batches(tiny, rank):
        trainer.step(x, y)
    trainer.close()
    del trainer
    gc.collect()


def _setup(variant: Variant, spec: RunSpec, rank: int, port: int) -> dict:
    """Everything up to ``ready``: world, prewarm, model, wrapper, warm-up; RSS read at each stage."""
    os.environ.update(dict(variant.env))
    _init_world(rank, spec.world_size, port, variant)
    _import_variant_library(variant)
    batches = make_batches(spec, rank)
    rss = {"cold": rss_bytes()}
    if spec.prewarm:
        _prewarm(variant, spec, rank)
    rss["before_model"] = rss_bytes()
    model = build_model(spec.model, spec.seed, variant.zero_init)
    num_params = sum(p.numel() for p in model.parameters())
    rss["after_model"] = rss_bytes()
    trainer = TRAINERS[variant.kind](model, spec, variant)
    del model  # the trainer holds it
    rss["after_wrap"] = rss_bytes()
    for i in range(spec.warmup_steps - 1):
        trainer.step(*batches[i % len(batches)])
        rss.setdefault("after_first_step", rss_bytes())
    breakdown = trainer.probe_step(*batches[(spec.warmup_steps - 1) % len(batches)])
    rss["after_warmup"] = rss_bytes()
    trainer.comm_start()
    return {"trainer": trainer, "batches": batches, "rss": rss, "breakdown": breakdown, "num_params": num_params}


def _finish(state: dict, timed_steps: int, step_index: int, world: int) -> dict:
    """The memory and communication report, read after the timed steps."""
    trainer, rss = state["trainer"], state["rss"]
    comm_bytes = trainer.comm_report(max(timed_steps, 1))
    rss["after_steps"] = rss_bytes()
    peak = peak_rss_bytes()
    # Diagnostic only: how much of the growth is free memory the allocator kept (not held tensors).
    rss["after_steps_malloc_trim"] = rss_bytes() if _release_free_heap() else None
    if isinstance(trainer, DeepSpeedTrainer):
        batches = state["batches"]
        comm_bytes = trainer.logged_comm_step(*batches[step_index % len(batches)], world)
    return {"rss": rss, "peak_rss": peak, "memory_breakdown": state["breakdown"], "comm": comm_bytes,
            "steps_total": step_index}


def _serve(variant: Variant, spec: RunSpec, rank: int, port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    state = _setup(variant, spec, rank, port)
    conn.send(("ready", {"num_params": state["num_params"], "setup_s": time.perf_counter() - started,
                         "torch": torch.__version__, "threads": torch.get_num_threads()}))
    step_index, timed_steps, last_loss = spec.warmup_steps, 0, float("nan")
    while True:
        command, arg = conn.recv()
        if command == "run":
            times, last_loss = _timed_steps(state["trainer"], state["batches"], step_index, arg)
            step_index += arg
            timed_steps += arg
            conn.send(("times", {"times": times, "loss": last_loss}))
        elif command == "finish":
            report = _finish(state, timed_steps, step_index, spec.world_size)
            conn.send(("finished", {**report, "loss": last_loss}))
            dist.destroy_process_group()
            return
        else:
            raise ValueError(f"unknown command {command!r}")
