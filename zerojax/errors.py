"""The exception and warning category of every user-facing zerojax message (no jax import)."""

from __future__ import annotations

import difflib


class ZeroError(ValueError):
    """A user mistake zerojax detected (config, state, batch or step); the message says what
    to change."""


class ZeroWarning(UserWarning):
    """Every zerojax warning (filter them with `warnings.filterwarnings(..., ZeroWarning)`)."""


def nearest(name: str, choices) -> str:
    """' (did you mean X?)' for the closest valid name, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""
