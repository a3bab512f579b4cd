"""Which parameters lie in a stack of layers, as Flax itself says while it builds them.

A lifted transform that stacks its parameters (`nn.scan`, `nn.vmap` over 'params') runs its
body on one layer's slice: the body sees fewer dims than the transform stores. `recording()`
watches the module calls of a Linen model's `init` (the init function `zero.init` and
`zero.eval_shape` trace) with Flax's method interceptor and records the dims each lifted body
saw; `stacked(seen, params)` compares them with the stored parameters. Where nothing was
recorded (a state built elsewhere and placed with `zero.shard`, an NNX model, whose
`nnx.vmap` leaves no trace at construction), the layout is provisional until the step's
first compile: its calls reveal the stacks (`flax.units.revealed_stacks`), never the shapes.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
from flax.core.scope import Scope

from zerojax.core.rules import path_str


@contextlib.contextmanager
def recording():
    """Inside, every lifted-transform body's call records {parameter path below `params`: the
    ndim the call saw} in the dict it yields, which also holds `RAN: True` once any Linen
    module has run (a model without lifted transforms: the fact that nothing is stacked)."""
    seen: dict = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        seen[RAN] = True
        module = context.module
        if module.path and isinstance(module.parent, Scope):  # a lifted transform's body
            prefix = "/".join(module.path)
            params = module.variables.get("params", {})
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
                seen.setdefault(f"{prefix}/{path_str(path)}", np.ndim(x))
        return out

    with nn.intercept_methods(record):
        yield seen


RAN = None  # the key `recording` sets once a Linen module has run


def stacked(seen: dict, params: dict) -> set | None:
    """The parameter paths stored with more dims than a lifted body saw (`params`: {path below
    `params`: leaf}): a stack's layers lead them. None when no Linen module ran (no facts)."""
    if RAN not in seen:
        return None
    stored = {path: np.ndim(x) for path, x in params.items()}
    return {p for p, ndim in seen.items() if p is not RAN and stored.get(p, ndim) > ndim}
