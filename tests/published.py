"""Published model code for the conformance lane, taken from the package registry as its
authors released it: Flax's examples come in Flax's source distribution on PyPI (Apache-2.0),
Gemma 4 in Google DeepMind's `gemma` wheel (Apache-2.0); both are downloaded once into a cache
and imported unchanged. Modules they import for data, logging, tokenizers or checkpoints
(tensorflow, clu, sentencepiece, an input pipeline) are replaced by stand-ins while they are
imported: they answer any attribute at import time and fail if anything calls them, so a train
step that used one would fail, not pass silently."""

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
# gemma's model code and the pure-Python packages it imports that the tests do not install,
# pinned; installed without dependencies (gemma's own pull in 186 packages, TensorFlow among them)
GEMMA = (
    "gemma==4.0.1",
    "kauldron==1.4.4",
    "einops==0.8.2",
    "immutabledict==4.3.1",
    "lark==1.3.1",
    "ml_collections==1.1.0",
    "typeguard==4.6.1",
)
GEMMA_STAND_INS = (
    "clu",
    "clu.data",
    "clu.data.dataset_iterator",
    "dialog",
    "sentencepiece",
    "tensorflow",
)


def cache_dir() -> pathlib.Path:
    default = pathlib.Path(tempfile.gettempdir()) / "zerojax-published"
    return pathlib.Path(os.environ.get("ZEROJAX_PUBLISHED_CACHE", default))


def _pip(what: str, *arguments: str) -> None:
    command = [sys.executable, "-m", "pip", *arguments, "-q"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(
            f"the conformance lane needs {what} from the package registry: "
            f"`{' '.join(command)}` failed:\n{done.stderr}"
        )


def _move(folder: pathlib.Path, root: pathlib.Path) -> None:
    """`folder` renamed to `root`, atomically: of two test processes filling the cache, one
    wins and the other keeps what it found."""
    try:
        os.replace(folder, root)
    except OSError:
        if not root.is_dir():
            raise


def flax_examples() -> pathlib.Path:
    """The examples/ folder of Flax's released source, downloaded from PyPI once."""
    root = cache_dir() / f"flax-{FLAX_EXAMPLES}"
    if not (root / "examples").is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
            source = ("--no-deps", "--no-binary", ":all:", "-d", tmp, f"flax=={FLAX_EXAMPLES}")
            _pip(f"Flax {FLAX_EXAMPLES}'s source distribution", "download", *source)
            (archive,) = pathlib.Path(tmp).glob("flax-*.tar.gz")
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            _move(pathlib.Path(tmp) / f"flax-{FLAX_EXAMPLES}", root)
    return root / "examples"


def gemma_modules(*names: str) -> types.SimpleNamespace:
    """gemma's named modules (by the last part of each name), imported unchanged from its wheel,
    installed once into the cache with the packages of `GEMMA` (appended to `sys.path`, so an
    installed copy of any of them wins)."""
    root = cache_dir() / ("gemma-" + GEMMA[0].split("==")[1])
    if not (root / "gemma").is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
            site = pathlib.Path(tmp) / "site"
            _pip("gemma's wheel", "install", "--no-deps", "--target", str(site), *GEMMA)
            _move(site, root)
    if str(root) not in sys.path:
        sys.path.append(str(root))
    with _stand_ins(GEMMA_STAND_INS):
        loaded = {n.rpartition(".")[2]: importlib.import_module(n) for n in names}
    return types.SimpleNamespace(**loaded)


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

    def __or__(self, other):  # an annotation evaluated at import: `ocp.CheckpointManager | None`
        return self

    __ror__ = __or__


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
