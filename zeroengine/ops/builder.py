"""Just-in-time build of the C++/CUDA ops.

An ``OpBuilder`` names an op's sources under ``ops/csrc/<op>/`` and its flags,
says whether the op can be built here (``is_compatible``), and ``load()``s it,
compiling through ``torch.utils.cpp_extension.load`` (ninja) on first use.

Note [build protocol]
---------------------
* Every input that changes the binary (source and header contents, compiler
  and linker flags, the compiler, the CUDA architectures) is hashed into the
  build directory's name, under a root that is per torch version and Python
  ABI (see cache.py). A changed input therefore means a new directory and a
  fresh build, never a stale binary, and old builds stay usable side by side.
* A build directory is complete once its marker file exists; the marker is
  written atomically after the extension is built. With the marker present,
  ``load()`` imports the shared library directly: no ninja run, no compiler
  probe.
* Without it, the process takes an exclusive ``fcntl.flock`` in the build
  directory. The first rank builds; the others wait, then find the marker and
  import. If the build they waited on failed, they fail with its reason rather
  than each retrying a slow doomed build; a process that starts later retries.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

import zeroengine
from zeroengine.ops.cache import cache_root, exclusive_lock, read_json, write_json_atomic
from zeroengine.ops.cpu_features import SimdLevel, simd_compile_flags, simd_level

logger = logging.getLogger(__name__)

CSRC_ROOT = Path(zeroengine.__file__).resolve().parent.parent / "ops" / "csrc"

_HEADER_SUFFIXES = (".h", ".hpp", ".cuh")
_MARKER = "ze_build.json"  # presence means the build directory holds a complete extension
_FAILURE = "ze_failed.json"  # reason and time of the latest failed build
_LOCK = "ze_build.lock"
_TORCH_BATON = "lock"  # torch.utils.cpp_extension's own lock file in the build directory

_loaded: dict[Path, ModuleType] = {}  # build directory -> module imported by this process
_failures: dict[str, str] = {}  # op name -> reason its last load failed in this process
# Build directory -> reason its build failed in this process. Same inputs fail
# the same way, and torch's in-process versioning would skip a second attempt.
_failed_builds: dict[Path, str] = {}
_logged: set[tuple[str, str]] = set()


class OpUnavailableError(RuntimeError):
    """The op cannot be built on this machine, or its build failed."""

    def __init__(self, op: str, reason: str):
        super().__init__(f"op {op} unavailable: {reason}")
        self.op = op
        self.reason = reason


class OpBuilder:
    """Builds and loads one op; subclasses set ``NAME``, ``SOURCE_DIR`` and ``SOURCES``."""

    NAME: str = ""
    SOURCE_DIR: str = ""  # folder under ops/csrc
    SOURCES: tuple[str, ...] = ()  # files in that folder
    USES_CUDA = False

    def __init__(self) -> None:
        self.compiled = False  # whether this instance ran the compiler

    @property
    def name(self) -> str:
        return self.NAME

    def source_dir(self) -> Path:
        return CSRC_ROOT / self.SOURCE_DIR

    def sources(self) -> list[Path]:
        return [self.source_dir() / name for name in self.SOURCES]

    def cxx_flags(self) -> list[str]:
        return ["-O3"]

    def nvcc_flags(self) -> list[str]:
        return []

    def ld_flags(self) -> list[str]:
        return []

    def is_compatible(self) -> tuple[bool, str]:
        """``(True, what will build it)`` or ``(False, why not)``; never builds."""
        from torch.utils.cpp_extension import is_ninja_available

        compiler = os.environ.get("CXX", "c++")  # the compiler torch's build will use
        compiler_path = shutil.which(compiler)
        if compiler_path is None:
            return False, f"C++ compiler {compiler!r} not found (install one or set CXX)"
        if not is_ninja_available():
            return False, "ninja not found (pip install ninja)"
        missing = [path for path in self.sources() if not path.is_file()]
        if missing:
            return False, f"source {missing[0]} missing (ops/csrc comes with a source checkout)"
        return True, f"compiler {compiler_path}"

    def build_dir(self) -> Path:
        """Where this op's build for the current sources and flags lives (built or not)."""
        return cache_root() / self.name / self._build_hash()

    def status(self) -> dict:
        """Compatibility and cache state, for ``ze_report``; never builds."""
        compatible, reason = self.is_compatible()
        if not compatible:  # its build directory may not even be defined (it hashes the flags)
            return {"name": self.name, "compatible": False, "reason": reason, "failure": None, "built": False,
                    "cache_path": ""}
        build_dir = self.build_dir()
        built = _read_marker(build_dir) is not None
        failure = _failures.get(self.name)  # why loading failed in this process
        if failure is None and not built:  # or why the last build of these sources failed
            saved = read_json(build_dir / _FAILURE)
            failure = None if saved is None else f"last build failed: {saved['reason']}"
        return {
            "name": self.name,
            "compatible": compatible,
            "reason": failure or reason,
            "failure": failure,
            "built": built,
            "cache_path": str(build_dir),
        }

    def load(self, verbose: bool = False) -> ModuleType:
        """The op's extension module, building it first if needed (Note [build protocol]).

        Raises ``OpUnavailableError`` with a one-line reason when it cannot be had.
        """
        compatible, reason = self.is_compatible()
        if not compatible:
            raise OpUnavailableError(self.name, reason)
        build_dir = self.build_dir()
        if build_dir in _failed_builds:
            raise OpUnavailableError(self.name, _failed_builds[build_dir])
        module = _loaded.get(build_dir)
        if module is None:
            info = _read_marker(build_dir) or self._build(build_dir, verbose)
            module = _import_extension(info["module"], build_dir / info["file"])
            _loaded[build_dir] = module
        _failures.pop(self.name, None)
        return module

    def load_or_none(self) -> ModuleType | None:
        """``load()``, or None after logging the reason once (see ``status()['reason']``)."""
        try:
            return self.load()
        except Exception as exc:  # users get one line; the traceback is at debug level
            reason = exc.reason if isinstance(exc, OpUnavailableError) else _first_line(str(exc))
            _failures[self.name] = reason
            if (self.name, reason) not in _logged:
                _logged.add((self.name, reason))
                logger.warning("op %s unavailable: %s", self.name, reason)
                logger.debug("op %s load failure", self.name, exc_info=True)
            return None

    # -- internals --------------------------------------------------------

    def _hash_extras(self) -> list[str]:
        """Inputs besides sources and flags that change the binary."""
        return [os.environ.get("CXX", "c++")]

    def _build_hash(self) -> str:
        digest = hashlib.sha256(self.name.encode())
        headers = [p for p in self.source_dir().glob("*") if p.suffix in _HEADER_SUFFIXES]
        for path in sorted({*self.sources(), *headers}):
            if path.is_file():  # a missing source is reported by is_compatible
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        for group in (self.cxx_flags(), self.nvcc_flags(), self.ld_flags(), self._hash_extras()):
            digest.update(b"\1" + "\0".join(group).encode())
        return digest.hexdigest()[:16]

    def _build(self, build_dir: Path, verbose: bool) -> dict:
        build_dir.mkdir(parents=True, exist_ok=True)
        waiting_since = time.time()
        with exclusive_lock(build_dir / _LOCK):
            info = _read_marker(build_dir)
            if info is not None:  # another process built it while we waited
                return info
            failure = read_json(build_dir / _FAILURE)
            if failure is not None and failure["time"] >= waiting_since:
                raise OpUnavailableError(self.name, failure["reason"])
            # We hold the lock, so no live build owns torch's baton: one left
            # behind by a killed build would make torch wait forever.
            (build_dir / _TORCH_BATON).unlink(missing_ok=True)
            # A first build takes tens of seconds: say so before it starts, not only after.
            logger.info("building op %s (first use with these sources and flags; cached afterwards) ...", self.name)
            start = time.perf_counter()
            try:
                module = self._compile(build_dir, verbose)
            except Exception as exc:
                _failed_builds[build_dir] = self._record_failure(build_dir, exc)
                raise OpUnavailableError(self.name, _failed_builds[build_dir]) from None
            info = {
                "module": module.__name__,
                "file": Path(module.__file__).name,
                "seconds": round(time.perf_counter() - start, 2),
                "cxx_flags": self.cxx_flags(),
                "nvcc_flags": self.nvcc_flags(),
                "pid": os.getpid(),
            }
            write_json_atomic(build_dir / _MARKER, info)
            (build_dir / _FAILURE).unlink(missing_ok=True)
            self.compiled = True
            logger.info("built op %s in %.1fs: %s", self.name, info["seconds"], build_dir)
            return info

    def _compile(self, build_dir: Path, verbose: bool) -> ModuleType:
        from torch.utils.cpp_extension import load

        return load(
            # Unique per build: torch tracks extension versions by name in-process.
            name=f"ze_{self.name}_{build_dir.name}",
            sources=[str(path) for path in self.sources()],
            extra_cflags=self.cxx_flags(),
            extra_cuda_cflags=self.nvcc_flags(),
            extra_ldflags=self.ld_flags(),
            extra_include_paths=[str(self.source_dir())],
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=self.USES_CUDA,
        )

    def _record_failure(self, build_dir: Path, exc: Exception) -> str:
        log = build_dir / "build_error.log"
        log.write_text(f"{type(exc).__name__}: {exc}\n")
        reason = f"build failed: {_first_error(str(exc))} (full log: {log})"
        write_json_atomic(build_dir / _FAILURE, {"reason": reason, "time": time.time()})
        return reason


class CPUOpBuilder(OpBuilder):
    """A C++ op compiled for this CPU's SIMD level (see cpu_features.py), with OpenMP."""

    def simd_level(self) -> SimdLevel:
        return simd_level()

    def cxx_flags(self) -> list[str]:
        return [*super().cxx_flags(), "-fopenmp", *simd_compile_flags(self.simd_level())]

    def ld_flags(self) -> list[str]:
        return [*super().ld_flags(), "-fopenmp"]

    def is_compatible(self) -> tuple[bool, str]:
        compatible, reason = super().is_compatible()
        try:
            level = self.simd_level()
        except ValueError as err:  # a ZEROENGINE_SIMD this module does not know: name it, never a traceback
            return False, str(err)
        return compatible, f"{reason}; SIMD {level.value}" if compatible else reason


class CUDAOpBuilder(OpBuilder):
    """An op with ``.cu`` sources, built with nvcc against a CUDA build of torch."""

    USES_CUDA = True

    def nvcc_flags(self) -> list[str]:
        return ["-O3"]

    def is_compatible(self) -> tuple[bool, str]:
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a build without CUDA"
        nvcc = find_nvcc()
        if nvcc is None:
            return False, "nvcc not found (set CUDA_HOME)"
        if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            return False, "no CUDA device visible and TORCH_CUDA_ARCH_LIST unset"
        compatible, reason = super().is_compatible()
        return compatible, f"{reason}; nvcc {nvcc}" if compatible else reason

    def compile_only(self, out_dir: Path) -> list[Path]:
        """Compile the ``.cu`` sources to object files with plain nvcc.

        Needs neither a GPU nor a CUDA torch (the device code includes no torch
        header), so CPU-only machines can still check that the kernels compile.
        """
        nvcc = find_nvcc()
        if nvcc is None:
            raise OpUnavailableError(self.name, "nvcc not found (set CUDA_HOME)")
        objects = []
        for source in self.sources():
            if source.suffix != ".cu":
                continue
            obj = Path(out_dir) / f"{source.stem}.o"
            cmd = [nvcc, "-c", "-std=c++17", *self.nvcc_flags(), f"-I{self.source_dir()}",
                   str(source), "-o", str(obj)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr}")
            objects.append(obj)
        return objects

    def _hash_extras(self) -> list[str]:
        # torch compiles for TORCH_CUDA_ARCH_LIST, else for the GPUs it sees.
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not arch and torch.cuda.is_available():
            capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            arch = ";".join(f"{major}.{minor}" for major, minor in sorted(capabilities))
        return [*super()._hash_extras(), str(find_nvcc()), arch or ""]


_WARNED_FALLBACK: set[str] = set()


def load_kernel(builder: OpBuilder, required: bool, optimizer: str, fallback: str) -> ModuleType | None:
    """The op's compiled module; without ``required``, None (and one RuntimeWarning per op) when unavailable."""
    if required:
        return builder.load()
    kernel = builder.load_or_none()
    if kernel is None and builder.name not in _WARNED_FALLBACK:
        _WARNED_FALLBACK.add(builder.name)
        warnings.warn(f"{optimizer}: {builder.name} op unavailable ({builder.status()['reason']}); using {fallback}",
                      RuntimeWarning, stacklevel=3)
    return kernel


def find_nvcc() -> str | None:
    """The nvcc torch's build would use: torch's CUDA_HOME, else $CUDA_HOME, else PATH."""
    from torch.utils.cpp_extension import CUDA_HOME

    home = CUDA_HOME or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _read_marker(build_dir: Path) -> dict | None:
    """The marker of a complete build; None if absent or its library was deleted."""
    info = read_json(build_dir / _MARKER)
    return info if info is not None and (build_dir / info["file"]).is_file() else None


def _import_extension(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "unknown error")


def _first_error(build_output: str) -> str:
    """The first compiler diagnostic in torch's build error, else its first line."""
    for line in build_output.splitlines():
        if "error:" in line.lower():  # gcc "f.cpp:3:1: error: ...", nvcc "f.cu(3): error: ..."
            return line.strip()[:300]
    return _first_line(build_output)[:300]
