"""The exception and warning category of every user-facing zerojax message, `warn`, the one
place a zerojax warning is given, and `-W ...::zerojax.ZeroWarning` honoured (no jax import)."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
import sysconfig
import warnings

from zerojax.core.trace_scope import current, scoped


class ZeroError(ValueError):
    """A user mistake zerojax detected (config, state, batch or step); the message says what
    to change."""


class ZeroWarning(UserWarning):
    """Every zerojax warning (filter them with `warnings.filterwarnings(..., ZeroWarning)`, or
    make them fatal with `python -W error::zerojax.ZeroWarning`)."""


def closest(name: str, choices) -> str | None:
    """The valid name closest to `name`, or None when nothing is close."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return match[0] if match else None


def nearest(name: str, choices) -> str:
    """' (did you mean X?)' for the closest valid name, or '' when nothing is close."""
    match = closest(name, choices)
    return f" (did you mean {match!r}?)" if match else ""


# frames in these directories are not the user's: a warning points past them
_LIBRARY_DIRS = tuple(
    os.path.join(d, "")
    for d in (
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # zerojax/
    )
)


@contextlib.contextmanager
def once_per(said: set):
    """Within: a `warn` without its own set appears once per `said` (a zero's record of what
    it has said), e.g. a warning given while a step is traced again for another variant. The
    outermost set wins, so a zero working for another (memory_budget's trials) says it once."""
    with scoped(said=current().said if current().said is not None else said):
        yield


def warn(message: str, said: set | None = None, cause: str | None = None) -> None:
    """Warn with ZeroWarning, pointing at the user's line (the first frame outside zerojax,
    the standard library and installed packages, so outside jax's tracing too). `said`, what
    its owner has said (inside `once_per`, that set instead), makes each `cause` (by default
    the message itself) appear once for that owner."""
    said = said if current().said is None else current().said
    if said is not None:
        if (cause or message) in said:
            return
        said.add(cause or message)
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category=ZeroWarning, stacklevel=level)


_ACTIONS = ("default", "error", "ignore", "always", "module", "once")
_NAMES = ("zerojax.ZeroWarning", "zerojax.core.errors.ZeroWarning")


def _apply_command_line_filters() -> None:
    """`python -W error::zerojax.ZeroWarning` (and PYTHONWARNINGS): Python reads -W before
    installed packages can be imported, so it ignores a category of theirs ("Invalid -W
    option ignored"); zerojax applies such options itself when it is imported."""
    for option in sys.warnoptions:
        action, message, category, module, lineno = ([*option.split(":"), "", "", "", ""])[:5]
        chosen = [a for a in _ACTIONS if a.startswith(action.strip() or "default")]
        if category.strip() not in _NAMES or len(chosen) != 1:
            continue
        warnings.filterwarnings(
            chosen[0],  # type: ignore[arg-type]
            re.escape(message.strip()),
            ZeroWarning,
            re.escape(module.strip()) + r"\Z" if module.strip() else "",
            int(lineno) if lineno.strip().isdigit() else 0,
        )


_apply_command_line_filters()
