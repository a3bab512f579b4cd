"""One compiled variant of a step, as a value: what its traced body reads, decided once per
compile key (the state's structure and shapes, the batch's, the argument order, micro-batch
or optimizer step) by `step.ZeroStep`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from zerojax.core.rules import StateLayout
from zerojax.engine.hook import TraceLog
from zerojax.engine.placement import Placement
from zerojax.flax.nnx import NnxLayout


@dataclasses.dataclass(frozen=True)
class Variant:
    """`fn`: the user's step taking `(state,), batch, *extra` (its arguments put back in the
    order the user passed them); `layout` and `shardings`: the state's, decided by the rules;
    `batch_rows`: the global batch sizes (leading dims of the batch leaves); `micro`: a
    micro-batch that only accumulates; `log`: what the trace found in the model calls;
    `objects`: the NNX layout when the step takes NNX objects."""

    placement: Placement
    fn: Callable
    name: str  # the user's step, as errors name it
    layout: StateLayout
    shardings: Any
    batch_rows: set
    micro: bool
    log: TraceLog
    objects: NnxLayout | None = None

    @property
    def update(self):
        """The managed update's policy (`core.policy.UpdatePolicy`)."""
        return self.placement.update

    @property
    def explicit(self) -> bool:
        """Whether the model's calls run per device with zerojax's collectives."""
        return self.placement.config.explicit_collectives
