"""Module paths a release documented, still importing after the folder moves (#39, #63): the
old path is a thin stand-in for the module it became, reading every name from it, and
importing it warns once (a ZeroWarning) with the path to use instead."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

from zerojax.core.errors import warn

MOVED = {  # old module path -> where it lives now
    "zerojax.launch": "zerojax.commands.launch",
    "zerojax.cli": "zerojax.commands.cli",
    "zerojax.plan_command": "zerojax.commands.plan",
    "zerojax.device_values": "zerojax.comm.device_values",
    "zerojax.offload": "zerojax.comm.offload",
    "zerojax.call_plan": "zerojax.core.call_plan",
    "zerojax.config": "zerojax.core.config",
    "zerojax.config_files": "zerojax.core.config_files",
    "zerojax.errors": "zerojax.core.errors",
    "zerojax.mesh": "zerojax.core.mesh",
    "zerojax.reference": "zerojax.core.reference",
    "zerojax.rules": "zerojax.core.rules",
    "zerojax.trace_scope": "zerojax.core.trace_scope",
    "zerojax.xla_flags": "zerojax.core.xla_flags",
    "zerojax.ds_optimizer": "zerojax.deepspeed.optimizer",
    "zerojax.deepspeed.reader": "zerojax.core.deepspeed_json",
    "zerojax.budget": "zerojax.engine.budget",
    "zerojax.checks": "zerojax.engine.checks",
    "zerojax.hook": "zerojax.engine.hook",
    "zerojax.local_step": "zerojax.engine.local_step",
    "zerojax.optim": "zerojax.update.managed",
    "zerojax.engine.optim": "zerojax.update.managed",
    "zerojax.outputs": "zerojax.engine.outputs",
    "zerojax.state": "zerojax.engine.state",
    "zerojax.step": "zerojax.engine.step",
    "zerojax.describe": "zerojax.inspect.describe",
    "zerojax.hlo": "zerojax.inspect.hlo",
    "zerojax.peak": "zerojax.inspect.peak",
    "zerojax.report": "zerojax.inspect.report",
    "zerojax.schedule": "zerojax.inspect.schedule",
    "zerojax.checkpoint": "zerojax.io.checkpoint",
    "zerojax.checkpoint_health": "zerojax.io.checkpoint_health",
    "zerojax.export": "zerojax.io.export",
    "zerojax.interop": "zerojax.io.interop",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of `MOVED` and makes it a stand-in for the new module."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warn(
            f"zerojax: {spec.name} moved to {new}: import it from there (the old path goes "
            "in a later release)."
        )
        target = importlib.import_module(new)
        stand_in = types.ModuleType(spec.name, target.__doc__)
        stand_in.__getattr__ = lambda name: getattr(target, name)
        stand_in.__dir__ = lambda: dir(target)
        return stand_in

    def exec_module(self, module):
        pass


def install() -> None:
    """Let the old paths import (once per interpreter)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
