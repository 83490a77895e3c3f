"""Thin setup.py so `pip install -e .` works with older pips; metadata lives in pyproject.toml.

``ZEROENGINE_BUILD_OPS=1 pip install .`` (or ``-e .``) also builds every op this
machine can build, ahead of time, into the JIT cache (see zeroengine/ops/build_all.py),
and fails the install if one of them fails to build.
"""
import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def build_ops_ahead_of_time() -> None:
    # pip builds in an isolated environment without torch; the build runs in the
    # interpreter's own environment, where torch is installed.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    env["PYTHONPATH"] = HERE
    subprocess.run([sys.executable, "-m", "zeroengine.ops.build_all"], cwd=HERE, env=env, check=True)


# Runs at interpreter start-up; honours ZEROENGINE_AS_DEEPSPEED (zeroengine/integrations/as_deepspeed.py).
SWITCH_PTH = os.path.join("zeroengine", "integrations", "zeroengine_as_deepspeed.pth")


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        self.install_switch_hook()
        if os.environ.get("ZEROENGINE_BUILD_OPS", "0") not in ("", "0"):
            build_ops_ahead_of_time()

    def install_switch_hook(self):
        # A .pth only runs from site-packages' top level. A wheel takes build_lib's top level there; an
        # editable install (PEP 660) keeps only what is written into the wheel's own tree, install_lib.
        top = self.build_lib
        if getattr(self, "editable_mode", False):
            top = self.get_finalized_command("install").install_lib
        self.copy_file(os.path.join(HERE, SWITCH_PTH), os.path.join(top, os.path.basename(SWITCH_PTH)))


setup(cmdclass={"build_py": BuildPyWithOps})
