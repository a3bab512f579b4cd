"""ZeroStep: the user's unchanged train step, jitted with the ZeRO shardings.

A step is built from values: the `Placement` its zero resolved (options, mesh, `Comm`,
policy views) and a function giving a state's layout; it never calls back into the API
object. Each call is checked, its batch placed, and its compile key (structures, shapes,
argument order, micro-batch or optimizer step) mapped to a `Variant` jitted once over
`traced.traced` (three bodies: global, local accumulation, NNX objects). What the step's
update leaves to read later (the micro-batch position, the loss scale at its minimum, a
skipped non-finite step) is kept as flags read at the next call, so steps still queue.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import jax
import numpy as np

from zerojax.core.errors import ZeroError, once_per, warn
from zerojax.core.mesh import without_memories
from zerojax.core.rules import StateLayout, placed_state, relaid
from zerojax.engine.checks import check_arity, check_call, pmap_collectives_named
from zerojax.engine.hook import TraceLog
from zerojax.engine.placement import Placement, place_batch
from zerojax.engine.state import StepCall, in_order, split_call
from zerojax.engine.traced import fallback_reason, traced
from zerojax.engine.variant import Variant
from zerojax.update.managed import zero_opt_state


class ZeroStep:
    """A zerojax train step: a `jax.jit` function with the state's shardings, donation and
    batch placement. `.trace(state, batch)` and `.lower(state, batch)` give the usual jax
    `Traced` and `Lowered` for inspection."""

    def __init__(
        self,
        placement: Placement,
        fn: Callable,
        layout: Callable[..., StateLayout],
        *,
        batch_argnum: int | None = None,
        static_argnums: tuple = (),
        fit: Callable | None = None,
    ):
        """`layout(tree, stacks=None)`: the state's `StateLayout` (the zero's cached rules;
        `stacks`, what the step's calls revealed for a provisional one, decide it from then on);
        `batch_argnum`, `static_argnums`: as `zero(step, ...)` takes them; `fit(keep,
        args) -> (step, report)`: memory_budget's trial compile with `keep_gathered=keep`."""
        self.placement, self.fn, self.layout = placement, fn, layout
        self.batch_argnum = batch_argnum  # where the batch stands, when not the first non-state
        self.static_argnums = tuple(static_argnums)  # Python arguments, as jax.jit's
        self._fit = fit
        self._jitted: dict[tuple, tuple] = {}  # compile key: (jitted, shardings, TraceLog)
        self._last: TraceLog | None = None  # what the trace of the variant last run found
        # the micro-batch position of the state the last call returned, known without reading
        # the device: a weak reference to that state's counter (never to the state itself)
        self._last_micro: weakref.ref | None = None
        self._next_micro, self._min_scale_flag = 0, None
        self._nonfinite_flag: tuple | None = None  # (skipped?, step, skipped so far), last update
        self._fitted: ZeroStep | None = None  # memory_budget: the step chosen to fit it
        self.budget = None  # memory_budget: the BudgetChoice made at the first call
        functools.update_wrapper(self, fn)

    def _budgeted(self, args) -> ZeroStep | None:
        """With a memory_budget, the step that fits it (chosen at the first call), else None."""
        if not self.placement.config.memory_budget:
            return None
        if self._fitted is None:
            from zerojax.engine.budget import fit_budget

            self._fitted, self.budget = fit_budget(self, args)
        return self._fitted

    # ---- calling -----------------------------------------------------------------------------
    def __call__(self, *args):
        """`step(state, batch, *extra)`, or for NNX objects `step(model, optimizer, ...,
        batch, *extra)` (the objects are updated in place and `fn`'s return value returned).
        Each warning it gives appears once per zero."""
        with once_per(self.placement.warned):
            return self._call(args)

    def _call(self, args):
        if (fitted := self._budgeted(args)) is not None:
            out = fitted(*args)
            self._last = fitted._last
            return out
        call = split_call(args, self.batch_argnum, self.static_argnums)
        check_call(call.state.tree, call.batch, call.extra)
        self._raise_if_scale_exhausted()
        self.check()
        micro_index = self._micro_index(call.state.tree)
        micro = self._is_micro(micro_index)
        jitted, shardings, log, moved, batch = self._prepare(call, micro, args)
        tree = relaid(call.state.tree, moved, shardings, self.placement.config.donate)
        tree = placed_state(tree, shardings)
        with pmap_collectives_named(self.fn, self.placement.mesh.axis_names):
            out = jitted(tree, batch, *call.extra)
        self._last = log
        self._warn_if_not_hooked()
        if call.state.objects is not None:  # NNX: the objects take the new state, fn's return
            new_tree, out = out
            call.state.objects.update(call.objects, new_tree)
            step = None
        else:
            new_tree = out[0] if isinstance(out, tuple) else out
            step = getattr(new_tree, "step", None)
        self._keep_flags(zero_opt_state(new_tree), micro_index, step)
        return out

    def _keep_flags(self, opt, micro_index: int, step) -> None:
        """What the next call reads of the update just queued (scalars, not the state)."""
        policy = self.placement.update
        if policy.accumulation_steps > 1:
            self._last_micro = weakref.ref(opt.micro)
            self._next_micro = (micro_index + 1) % policy.accumulation_steps
        if policy.scales_loss_dynamically:
            self._min_scale_flag = opt.overflow_at_min_scale
        if policy.on_nonfinite != "off" and not self._is_micro(micro_index):
            self._nonfinite_flag = (opt.last_skipped, step, opt.skipped)

    def check(self) -> None:
        """Report a non-finite gradient in the last optimizer step (read lazily, at the next
        call, so steps still queue asynchronously): on_nonfinite='skip' warns with the step
        number, 'stop' raises ZeroError."""
        if self._nonfinite_flag is None:
            return
        (skipped, step, total), self._nonfinite_flag = self._nonfinite_flag, None
        if not bool(skipped):
            return
        where = "in the last optimizer step" if step is None else f"at step {int(step)}"
        message = f"non-finite gradients (NaN or inf) {where}: the update was not applied"
        if self.placement.update.on_nonfinite == "stop":
            raise ZeroError(
                f"{message}; stopping (on_nonfinite='stop'). The state that call "
                "returned is the last good one, unchanged by the bad step."
            )
        warn(f"zerojax: {message} ({int(total)} skipped so far; on_nonfinite='skip').")

    def trace(self, *args, micro: bool = False) -> jax.stages.Traced:
        """Trace the optimizer-step variant (or, with micro=True, the accumulate-only one):
        the usual jax `Traced`, with its `.jaxpr`."""
        with once_per(self.placement.warned):
            return self._trace(args, micro)

    def _trace(self, args, micro: bool) -> jax.stages.Traced:
        if (fitted := self._budgeted(args)) is not None:
            traced_step = fitted.trace(*args, micro=micro)
            self._last = fitted._last
            return traced_step
        call = split_call(args, self.batch_argnum, self.static_argnums)
        jitted, shardings, log, moved, batch = self._prepare(call, micro, args)
        tree = relaid(call.state.tree, moved, shardings, donate=False)
        with pmap_collectives_named(self.fn, self.placement.mesh.axis_names):
            traced_step = jitted.trace(tree, batch, *call.extra)
        self._last = log
        self._warn_if_not_hooked()
        return traced_step

    def units_of(self, *args) -> tuple[str, ...]:
        """The paths of the modules stage 3 gathers as units in `self(*args)` (found by
        tracing it; below `params`, e.g. 'blocks_0' or, for NNX, 'blocks/0')."""
        self.trace(*args)
        return self.units or ()

    @property
    def units(self) -> tuple[str, ...] | None:
        """The stage-3 units of the variant last called or traced (None before any)."""
        return None if self._last is None else self._last.units

    @property
    def used_explicit_collectives(self) -> bool | None:
        """Whether the variant last called or traced ran a model call per device with
        zerojax's collectives (None before any)."""
        return None if self._last is None else self._last.hooked

    def lower(self, *args, micro: bool = False) -> jax.stages.Lowered:
        """`trace(...)` lowered: the usual jax `Lowered`, to compile or inspect."""
        return self.trace(*args, micro=micro).lower()

    def _micro_index(self, tree) -> int:
        policy = self.placement.update
        if not policy.manages:
            return 0
        opt = zero_opt_state(tree)
        if opt is None:
            raise ZeroError(
                "this zero_shard manages the update (precision, accumulation or "
                "clipping): create the state (or NNX objects) with zero.init(...) or "
                "zero.shard(...) so it carries the master weights and buffers."
            )
        if policy.accumulation_steps == 1:
            return 0
        if self._last_micro is not None and self._last_micro() is opt.micro:
            return self._next_micro
        return int(opt.micro)  # a state from elsewhere: read its position once

    def _is_micro(self, micro_index: int) -> bool:
        return micro_index < self.placement.update.accumulation_steps - 1

    def _raise_if_scale_exhausted(self):
        if self._min_scale_flag is not None and bool(self._min_scale_flag):
            raise ZeroError(
                f"fp16 gradients still overflow with the loss scale at min_loss_scale="
                f"{self.placement.update.min_loss_scale}: training cannot proceed (the last "
                "state returned holds the last good parameters). Lower the learning rate, use "
                "precision='bf16', or lower min_loss_scale."
            )

    def _prepare(self, call: StepCall, micro: bool, args: tuple):
        """(jitted function, state shardings, its TraceLog, the shardings of a provisional
        layout the state moves from (else None), placed batch), compiled once per structure,
        shapes, argument order and variant; the checks that depend only on those (`args`:
        the user's call) run then, off the per-call path."""
        tree, objects, extra = call.state.tree, call.state.objects, call.extra
        batch = place_batch(self.placement, call.batch)
        key = (
            jax.tree_util.tree_structure((tree, batch, extra)),
            micro,
            call.order,
            None if objects is None else objects.graphdef,
            tuple(np.shape(x) for x in jax.tree_util.tree_leaves((tree, batch))),
        )
        if key not in self._jitted:
            check_arity(self.fn, len(args), ", ".join(type(a).__name__ for a in args))
            self._check_compilable(tree)
            self._jitted[key] = self._compiled(call, batch, micro)
        return (*self._jitted[key], batch)

    def _compiled(self, call: StepCall, batch, micro: bool) -> tuple:
        """(jitted, shardings, TraceLog, moved-from shardings) of a new compile key. A state
        whose layout nothing has described (placed by `zero.shard`, NNX objects: Flax says
        where its stacks are only while a Linen model is built) is traced once on that
        provisional layout for the facts its calls reveal; where they re-decide it, the step
        compiles on the new one and the state moves there once, at this first call."""
        v = self._variant(call, batch, micro, self.layout(call.state.tree))
        jitted = self._jit(v)
        if v.layout.stacks is not None or not self.placement.config.uses_units:  # stage 0
            return jitted, v.shardings, v.log, None
        with pmap_collectives_named(self.fn, self.placement.mesh.axis_names):
            jitted.trace(call.state.tree, batch, *call.extra)  # jit keeps the trace for the call
        layout = self.layout(call.state.tree, frozenset(v.log.stacks))
        if layout.plans == v.layout.plans:
            return jitted, v.shardings, v.log, None
        moved = self._variant(call, batch, micro, layout)
        return self._jit(moved), moved.shardings, moved.log, v.shardings

    def _jit(self, v: Variant):
        """`v`'s traced body under `jax.jit`, donating the state when the options say so."""
        donate = (0,) if self.placement.config.donate else ()
        return jax.jit(functools.partial(traced, v), donate_argnums=donate)

    def _variant(self, call: StepCall, batch, micro: bool, layout: StateLayout) -> Variant:
        """The variant of this compile key on `layout`, as a value its traced body reads."""
        rows = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x)}
        return Variant(
            placement=self.placement,
            fn=in_order(self.fn, call.order),
            name=getattr(self.fn, "__name__", "the step"),
            layout=layout,
            shardings=layout.shardings(self.placement.mesh),
            batch_rows=rows,
            micro=micro,
            log=TraceLog(),
            objects=call.state.objects,
        )

    def _check_compilable(self, tree) -> None:
        """Refuse a step this placement cannot lower as asked (see the messages)."""
        config = self.placement.config
        if config.uses_host_memory and without_memories(self.placement.mesh.devices.flat):
            raise ZeroError(  # JAX would drop every memory kind: a step without offload
                "this mesh's devices describe no memories (compile-only GPUs), so a step "
                "lowered for them would keep everything on the device and offload nothing; "
                "zero.report(step, state, batch) and `zerojax plan --topology` lower it on "
                "CPU devices and compile it for these GPUs with its host memory."
            )
        if not self.placement.update.manages and zero_opt_state(tree) is not None:
            raise ZeroError(  # its optax would hand the gradients to nobody: no update
                "this state holds master weights and buffers from a zero_shard that "
                "manages the update (precision, accumulation or clipping), but this "
                "zero_shard does not manage it. Decorate the step with the zero that made "
                "the state (same precision, gradient_accumulation_steps, "
                "gradient_clipping), or create the state with this zero's zero.init."
            )

    def _warn_if_not_hooked(self):
        config = self.placement.config
        if not (config.explicit_collectives and config.shards_gradients):
            return
        if self.used_explicit_collectives is False:
            cost = (
                "stage 3 then gathers the parameters where XLA chooses, not unit by unit, so "
                "the peak holds many layers' weights"
                if config.shards_parameters
                else f"on CPU, stage {config.stage} then all-reduces the gradients instead of "
                "reduce-scattering them"
            )
            name = getattr(self.fn, "__name__", "the step")
            reason = fallback_reason(config.explicit_collectives, name)
            warn(
                f"zerojax: {reason}, so XLA's partitioner places every collective, ZeRO's "
                f"included ({cost})."
            )
