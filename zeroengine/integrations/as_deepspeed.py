"""The ``ZEROENGINE_AS_DEEPSPEED`` switch: ``import deepspeed`` resolves to zeroengine.

Hugging Face's Trainer, accelerate and everything built on them reach ZeRO through ``import deepspeed``
after asking whether it is installed (``importlib.util.find_spec("deepspeed")`` and
``importlib.metadata.version("deepspeed")``). With the switch on, a finder placed first on
``sys.meta_path`` answers both: every ``deepspeed[.x.y]`` module is the zeroengine module
``zeroengine.integrations.ds_compat[.x.y]`` (the same object under two names), and the distribution
``deepspeed`` is reported at :data:`DEEPSPEED_VERSION`, ahead of a real DeepSpeed install. The same finder
gives accelerate a gloo backend on machines without an accelerator (:mod:`.accelerate_cpu`).

How it is switched on: ``zeroengine_as_deepspeed.pth``, which ``pip install`` puts in site-packages,
runs :func:`install` at interpreter start-up when the environment says ``ZEROENGINE_AS_DEEPSPEED=1``
(so it holds under ``python``, ``torchrun``, ``accelerate launch`` and ``zeroengine --as_deepspeed``,
whose processes inherit the variable). Without the variable nothing is installed and nothing of
zeroengine is imported at start-up. This module imports only the standard library: it runs in every
interpreter that starts with the variable set.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import site
import sys

from zeroengine.integrations import accelerate_cpu

ENV_VAR = "ZEROENGINE_AS_DEEPSPEED"

# The DeepSpeed version reported to transformers and accelerate, which pick code paths by it: 0.19.8, the DeepSpeed
# whose behaviour the alias gives (its API, config keys and defaults, e.g. gradient_clipping 1.0, DeepSpeed's default
# since 0.19.3; docs/migrating-from-deepspeed.md compares against 0.19.8). Every gate of transformers 5.24 and
# accelerate 1.15 is at or below it: the highest, ``>= 0.18.2``, opens Ulysses sequence parallelism (ALST) through
# ``ParallelismConfig(sp_backend="deepspeed")``; the others are lower (``>= 0.16.4`` tensor parallelism, ``>= 0.14.4``
# ``engine.compile``, ``>= 0.9.3`` the floor), and none compares against a 0.19 version, so reporting 0.19.8 opens
# no path that 0.18.2 kept closed. docs/integrations.md lists every gate and how zeroengine meets it.
DEEPSPEED_VERSION = "0.19.8"

ALIAS = "deepspeed"
TARGET = "zeroengine.integrations.ds_compat"
OFF_VALUES = ("", "0", "false", "no", "off")  # compared stripped and lower-cased
HOOK_NAME = "zeroengine_as_deepspeed.pth"


def requested(environ=None) -> bool:
    """Whether the environment asks for the switch (``ZEROENGINE_AS_DEEPSPEED`` set and not 0/false/no/off)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() not in OFF_VALUES


def _target_name(fullname: str) -> str | None:
    if fullname == ALIAS:
        return TARGET
    if fullname.startswith(ALIAS + "."):
        return TARGET + fullname[len(ALIAS):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already imported zeroengine module: ``deepspeed.x`` *is* ``ds_compat.x``."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass  # already executed under its zeroengine name


class _PatchAfterLoad(importlib.abc.Loader):
    """Runs a module's own loader, then a patch on the new module (accelerate_cpu.py says why)."""

    def __init__(self, loader, patch):
        self.loader = loader
        self.patch = patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _DeepSpeedDistribution(importlib.metadata.Distribution):
    """The metadata ``importlib.metadata`` reports for ``deepspeed`` while the switch is on."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {DEEPSPEED_VERSION}\n"
                    "Summary: zeroengine, standing in for DeepSpeed (ZEROENGINE_AS_DEEPSPEED=1)\n"
                    "Author: zeroengine\n")
        return None

    def locate_file(self, path):
        return os.path.join(os.path.dirname(__file__), str(path))


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``deepspeed`` and its submodules to ``zeroengine.integrations.ds_compat``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == accelerate_cpu.MODULE:
            return self._patched_spec(fullname, path, target)
        target_name = _target_name(fullname)
        if target_name is None:
            return None
        if importlib.util.find_spec(target_name) is None:
            return None  # no such module here either: the import fails as for any missing module
        module = importlib.import_module(target_name)  # (its own import errors propagate, unchanged)
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), origin=getattr(module, "__file__", None),
                                              is_package=hasattr(module, "__path__"))
        if hasattr(module, "__path__"):
            spec.submodule_search_locations = list(module.__path__)
        return spec

    def _patched_spec(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterLoad(spec.loader, accelerate_cpu.patch_partial_state)
                return spec
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is not None and name.replace("-", "_").replace(".", "_").lower() == ALIAS:
            yield _DeepSpeedDistribution()


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (idempotent). A real ``deepspeed`` imported before
    this call stays as it is in ``sys.modules``: switch on before anything imports it (the .pth does)."""
    if not active():
        sys.meta_path.insert(0, DeepSpeedAliasFinder())
    if accelerate_cpu.MODULE in sys.modules:  # imported before the switch: patch it where it is
        accelerate_cpu.patch_partial_state(sys.modules[accelerate_cpu.MODULE])


def active() -> bool:
    """Whether the finder is installed in this interpreter."""
    return any(isinstance(finder, DeepSpeedAliasFinder) for finder in sys.meta_path)


def startup_hook_installed() -> str | None:
    """The path of the start-up ``.pth`` that honours the variable, or None when it is missing
    (ze_report says so: ``pip install`` zeroengine again to restore it).

    Only where ``site`` runs ``.pth`` files counts: the site-packages directories and, when enabled, the user's
    site-packages. A copy in the current directory or on ``PYTHONPATH`` is on ``sys.path`` but never runs."""
    for directory in _site_directories():
        candidate = os.path.join(directory, HOOK_NAME)
        if os.path.isfile(candidate):
            return candidate
    return None


def _site_directories() -> list[str]:
    """The directories whose ``.pth`` files ``site`` runs at start-up, in its order."""
    directories = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE and hasattr(site, "getusersitepackages"):
        directories.append(site.getusersitepackages())
    return [d for d in directories if d]
