"""Published model code for the conformance lane, taken from the package registry as its
authors released it: Flax's examples come in Flax's source distribution on PyPI (Apache-2.0),
downloaded once into a cache and imported unchanged. Modules an example imports for data,
logging or checkpoints (tensorflow, clu, its input pipeline) are replaced by stand-ins while
it is imported: they answer any attribute at import time and fail if anything calls them, so a
train step that used one would fail, not pass silently."""

from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import types

import flax.io  # noqa: F401  (decides whether tensorflow exists before any stand-in does)

# the newest Flax release with a source distribution (later ones ship wheels alone); its
# examples run on the Flax the tests install
FLAX_EXAMPLES = "0.12.8"


def cache_dir() -> pathlib.Path:
    default = pathlib.Path(tempfile.gettempdir()) / "zerojax-published"
    return pathlib.Path(os.environ.get("ZEROJAX_PUBLISHED_CACHE", default))


def flax_examples() -> pathlib.Path:
    """The examples/ folder of Flax's released source, downloaded from PyPI once."""
    root = cache_dir() / f"flax-{FLAX_EXAMPLES}"
    if not (root / "examples").is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary"]
            command += [":all:", f"flax=={FLAX_EXAMPLES}", "-d", tmp, "-q"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode:
                raise RuntimeError(
                    f"the conformance lane needs Flax {FLAX_EXAMPLES}'s source distribution "
                    f"from the package registry: `{' '.join(command)}` failed:\n{done.stderr}"
                )
            (archive,) = pathlib.Path(tmp).glob("flax-*.tar.gz")
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            os.replace(pathlib.Path(tmp) / f"flax-{FLAX_EXAMPLES}", root)  # atomic: one wins
    return root / "examples"


class StandIn(types.ModuleType):
    """A module an example imports for something the train step does not use."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"the published step called {self.__name__}, a stand-in")

    def __mro_entries__(self, bases):  # a class the example derives from one of them
        return (object,)


@contextlib.contextmanager
def _stand_ins(names):
    saved = {n: sys.modules.get(n) for n in names}
    for name in names:
        sys.modules[name] = StandIn(name)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load(example: str, modules: tuple, stand_ins: tuple = ()) -> types.SimpleNamespace:
    """The named modules of a Flax example, imported unchanged from its folder (its sibling
    imports, `import models`, resolved there; `stand_ins` replaced while importing)."""
    folder = str(flax_examples() / example)
    local = {p.stem for p in pathlib.Path(folder).glob("*.py")}
    for name in local:  # another example's `models` or `train` must not answer
        sys.modules.pop(name, None)
    sys.path.insert(0, folder)
    try:
        with _stand_ins(stand_ins):
            loaded = {m: importlib.import_module(m) for m in modules}
    finally:
        sys.path.remove(folder)
        for name in local:
            sys.modules.pop(name, None)
    return types.SimpleNamespace(**loaded)
