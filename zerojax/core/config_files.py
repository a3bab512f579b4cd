"""DeepSpeed-style JSON config files: the presets shipped in the package, found by name from any
directory, and `read_config`, the one reader of a config given as a path, a name or a dict."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from zerojax.core.errors import ZeroError, nearest

PRESETS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")  # zerojax/configs


def presets() -> list[str]:
    """Names of the DeepSpeed-style presets shipped with zerojax ('zero3_offload', ...)."""
    return sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".json"))


def config_path(source: str | os.PathLike) -> str:
    """The JSON file `source` names: a path that exists, else a shipped preset by name
    ('zero3', 'zero3.json' or 'configs/zero3.json' from any directory)."""
    path = os.fspath(source)
    if os.path.exists(path):
        return path
    name = os.path.basename(path)
    name = name[:-5] if name.endswith(".json") else name
    if name in presets():
        return os.path.join(PRESETS_DIR, name + ".json")
    raise ZeroError(
        f"config file {path!r} does not exist and is not a zerojax preset"
        f"{nearest(name, presets())}; presets: {', '.join(presets())}."
    )


def read_config(source: str | os.PathLike | Mapping[str, Any]) -> dict:
    """The DeepSpeed-style config `source` holds: a dict as is, else the JSON file it names."""
    if isinstance(source, Mapping):
        return dict(source)
    path = config_path(source)
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ZeroError(f"config file {path!r} is not valid JSON: {e}.") from None
