"""OpBuilder: cache layout, reuse, rebuild on change, multi-process safety, fallback.

A tiny "probe" op written with the bare Python C API stands in for real ops:
it compiles in about a second, so these tests exercise real builds cheaply.
"""
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeroengine.ops import builder as builder_module
from zeroengine.ops.builder import OpBuilder, OpUnavailableError
from zeroengine.ops.cache import CACHE_ENV, cache_root
from zeroengine.ops.cpu_features import SIMD_ENV, SimdLevel, simd_compile_flags, simd_level
from zeroengine.ops.op_builders import CPUAdamBuilder
from zeroengine.ops.registry import all_builders, format_status_table

PROBE_SOURCE = r"""
#include <Python.h>
#define ZE_CAT(a, b) a##b
#define ZE_INIT(name) ZE_CAT(PyInit_, name)
#define ZE_STR2(x) #x
#define ZE_STR(x) ZE_STR2(x)
static struct PyModuleDef probe = {PyModuleDef_HEAD_INIT, ZE_STR(TORCH_EXTENSION_NAME), NULL, -1, NULL};
PyMODINIT_FUNC ZE_INIT(TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&probe);
  if (m != NULL) PyModule_AddIntConstant(m, "ANSWER", ANSWER);
  return m;
}
"""


class ProbeBuilder(OpBuilder):
    NAME = "probe"
    SOURCES = ("probe.cpp",)

    def __init__(self, src_dir, answer=42):
        super().__init__()
        self._src_dir = Path(src_dir)
        self._answer = answer

    def source_dir(self):
        return self._src_dir

    def cxx_flags(self):
        return [*super().cxx_flags(), f"-DANSWER={self._answer}"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(path))
    monkeypatch.setattr(builder_module, "_loaded", {})  # forget modules imported by other tests
    monkeypatch.setattr(builder_module, "_failures", {})
    monkeypatch.setattr(builder_module, "_failed_builds", {})
    return path


@pytest.fixture
def probe_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe.cpp").write_text(PROBE_SOURCE)
    return src


def _extension_file(builder):
    info = json.loads((builder.build_dir() / "ze_build.json").read_text())
    return builder.build_dir() / info["file"]


def test_status_does_not_build(cache):
    status = CPUAdamBuilder().status()
    assert set(status) == {"name", "compatible", "reason", "failure", "built", "cache_path"}
    assert status["name"] == "cpu_adam" and status["built"] is False
    assert Path(status["cache_path"]).is_relative_to(cache_root())
    assert str(cache_root()).startswith(str(cache))
    assert not cache.exists()


def test_simd_level_and_flags(monkeypatch):
    monkeypatch.delenv(SIMD_ENV, raising=False)
    assert simd_level(frozenset({"avx512f", "avx2", "fma"})) is SimdLevel.AVX512
    assert simd_level(frozenset({"avx2", "fma", "f16c"})) is SimdLevel.AVX2
    assert simd_level(frozenset({"avx2"})) is SimdLevel.SCALAR  # AVX2 without FMA
    assert "-DZE_USE_AVX512" in simd_compile_flags(SimdLevel.AVX512, frozenset())
    assert simd_compile_flags(SimdLevel.AVX2, frozenset({"f16c"})) == [
        "-mavx2", "-mfma", "-mf16c", "-DZE_USE_AVX2"]
    assert "-mf16c" not in simd_compile_flags(SimdLevel.AVX2, frozenset())
    assert simd_compile_flags(SimdLevel.SCALAR) == []
    monkeypatch.setenv(SIMD_ENV, "scalar")
    assert simd_level(frozenset({"avx512f"})) is SimdLevel.SCALAR
    monkeypatch.setenv(SIMD_ENV, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        simd_level()


def test_build_then_reuse_without_recompiling(cache, probe_dir, monkeypatch):
    first = ProbeBuilder(probe_dir)
    assert first.status()["built"] is False
    assert first.load().ANSWER == 42
    assert first.compiled and first.status()["built"]
    assert first.build_dir().parent == cache_root() / "probe"
    library = _extension_file(first)
    mtime = library.stat().st_mtime_ns

    # A new process (simulated: no module imported yet) must import the cached
    # library without invoking torch's build at all.
    monkeypatch.setattr(builder_module, "_loaded", {})

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt an up-to-date op")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_build)
    second = ProbeBuilder(probe_dir)
    assert second.load().ANSWER == 42
    assert not second.compiled
    assert library.stat().st_mtime_ns == mtime


def test_changed_flags_or_sources_get_a_new_build(cache, probe_dir):
    base = ProbeBuilder(probe_dir)
    other_flags = ProbeBuilder(probe_dir, answer=7)
    assert other_flags.build_dir() != base.build_dir()
    assert base.load().ANSWER == 42
    assert other_flags.load().ANSWER == 7
    assert other_flags.compiled

    original = base.build_dir()
    (probe_dir / "probe.cpp").write_text(PROBE_SOURCE + "\n// edited\n")
    edited = base.build_dir()
    (probe_dir / "probe.h").write_text("// a header is an input too\n")
    assert len({original, edited, base.build_dir()}) == 3


def test_concurrent_loads_build_once(cache, probe_dir):
    # Both children wait for the same instant after importing torch, then load.
    start_at = str(time.time() + 3.0)
    children = [
        subprocess.Popen([sys.executable, __file__, str(probe_dir), start_at],
                         stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        for _ in range(2)
    ]
    results = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    assert all(child.returncode == 0 for child in children)
    assert [r["answer"] for r in results] == [42, 42]
    assert sorted(r["compiled"] for r in results) == [False, True]
    marker = json.loads((ProbeBuilder(probe_dir).build_dir() / "ze_build.json").read_text())
    assert marker["pid"] == next(r["pid"] for r in results if r["compiled"])


def test_missing_compiler_falls_back_with_reason(cache, probe_dir, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    probe = ProbeBuilder(probe_dir)
    compatible, reason = probe.is_compatible()
    assert not compatible and "/nonexistent/c++" in reason
    assert probe.load_or_none() is None
    assert probe.status()["reason"] == reason
    with pytest.raises(OpUnavailableError, match="not found"):
        probe.load()
    assert not cache.exists()


def test_failed_build_gives_one_line_reason(cache, probe_dir, caplog):
    (probe_dir / "probe.cpp").write_text("this is not C++;\n" + PROBE_SOURCE)
    probe = ProbeBuilder(probe_dir)
    assert probe.load_or_none() is None
    reason = probe.status()["reason"]
    assert "\n" not in reason and reason.startswith("build failed:") and "error" in reason
    assert (probe.build_dir() / "build_error.log").is_file()
    def warnings():
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings() == [f"op probe unavailable: {reason}"]  # (the INFO line before it says a build started)
    assert probe.load_or_none() is None  # not rebuilt in this process, and not logged again
    assert len(warnings()) == 1 and probe.status()["reason"] == reason
    assert not probe.status()["built"]
    # another process (a later ze_report, build_all's table) reads why from the build directory
    builder_module._failures.clear()
    later = probe.status()
    assert later["failure"] == f"last build failed: {reason}" and later["reason"] == later["failure"]
    assert f"last build failed: {reason}" in format_status_table([later])


def test_an_unknown_simd_level_is_a_reason_not_a_traceback(cache, monkeypatch):
    monkeypatch.setenv(SIMD_ENV, "avx3")
    status = CPUAdamBuilder().status()
    assert not status["compatible"] and "ZEROENGINE_SIMD='avx3': expected one of" in status["reason"]
    assert CPUAdamBuilder().load_or_none() is None


def test_registry_lists_every_op(cache):
    builders = all_builders()
    names = ["cpu_adam", "fused_adam", "moe_dispatch", "moe_dispatch_cuda", "async_io"]
    assert [b.name for b in builders] == names
    table = format_status_table([b.status() for b in builders])
    assert all(name in table for name in names)


if __name__ == "__main__":  # child process of test_concurrent_loads_build_once
    src_dir, start_at = sys.argv[1], float(sys.argv[2])
    time.sleep(max(0.0, start_at - time.time()))
    probe = ProbeBuilder(src_dir)
    module = probe.load()
    print(json.dumps({"answer": module.ANSWER, "compiled": probe.compiled, "pid": os.getpid()}))
