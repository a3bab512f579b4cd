"""ZeroStep: the user's unchanged train step, jitted with the ZeRO shardings.

Three ways to trace it, by configuration:
- plain: the user's step as is, with the `apply_fn` hook placing the collectives;
- managed (16-bit, clipping, 'reduced' accumulation): the step sees fp32 views of its
  parameters, its `apply_gradients` hands the gradients over (`optim.ZeroTx`), and zerojax
  applies the update on the fp32 master weights in XLA's global view (`optim.apply_update`);
- local accumulation (stages 0-2, k > 1): the whole step runs per device, as under DDP's
  `no_sync`: each device sums its own gradients, and only the k-th micro-batch reduces them,
  once, before the same `apply_update` (`zerojax.engine.local_step`).
NNX objects take the first two ways (`_traced_objects`). What the user's step returns is read
by `zerojax.engine.outputs`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.comm.hierarchy import manual_over_data
from zerojax.comm.offload import optimizer_on_host, to_device, to_storage
from zerojax.core.config import ZeroError
from zerojax.core.errors import once_per, warn
from zerojax.core.mesh import without_memories
from zerojax.core.rules import OPT_STATE, PARAMS, category_of, check_placed
from zerojax.engine.checks import check_arity, check_call
from zerojax.engine.hook import TraceLog, hooked_apply_fn
from zerojax.engine.local_step import local_body
from zerojax.engine.optim import (
    ZeroOptState,
    accumulate,
    apply_update,
    cast_floating,
    managed_update,
    present,
    settle,
    updating,
    zero_opt_state,
)
from zerojax.engine.outputs import finish, one_capture, same_structure, split_output, with_metrics
from zerojax.engine.state import StepCall, in_order, split_call
from zerojax.flax.model_calls import linen_calls_hooked, nnx_calls_hooked
from zerojax.flax.nnx_managed import ManagedObjects


class ZeroStep:
    """A zerojax train step: a `jax.jit` function with the state's shardings, donation and
    batch placement. `.trace(state, batch)` and `.lower(state, batch)` give the usual jax
    `Traced` and `Lowered` for inspection."""

    def __init__(self, zero, fn, batch_argnum: int | None = None, static_argnums: tuple = ()):
        self.zero, self.fn = zero, fn
        self.batch_argnum = batch_argnum  # where the batch stands, when not the first non-state
        self.static_argnums = tuple(static_argnums)  # Python arguments, as jax.jit's
        self._jitted: dict[tuple, tuple] = {}  # compile key: (jitted, shardings, TraceLog)
        self._last: TraceLog | None = None  # what the trace of the variant last run found
        # the micro-batch position of the state the last call returned, known without reading
        # the device: a weak reference to that state's counter (never to the state itself)
        self._last_micro: weakref.ref | None = None
        self._next_micro, self._min_scale_flag = 0, None
        self._nonfinite_flag = None  # (skipped?, step, skipped so far) of the last update
        self._fitted: ZeroStep | None = None  # memory_budget: the step chosen to fit it
        self.budget = None  # memory_budget: the BudgetChoice made at the first call
        functools.update_wrapper(self, fn)

    def _budgeted(self, args) -> ZeroStep | None:
        """With a memory_budget, the step that fits it (chosen at the first call), else None."""
        if not self.zero.config.memory_budget:
            return None
        if self._fitted is None:
            from zerojax.engine.budget import fit_budget

            options = {"batch_argnum": self.batch_argnum, "static_argnums": self.static_argnums}
            self._fitted, self.budget = fit_budget(self.zero, self.fn, args, options)
        return self._fitted

    # ---- calling -----------------------------------------------------------------------------
    def __call__(self, *args):
        """`step(state, batch, *extra)`, or for NNX objects `step(model, optimizer, ...,
        batch, *extra)` (the objects are updated in place and `fn`'s return value returned).
        Each warning it gives appears once per zero."""
        with once_per(self.zero.warned):
            return self._call(args)

    def _call(self, args):
        if (fitted := self._budgeted(args)) is not None:
            out = fitted(*args)
            self._last = fitted._last
            return out
        call = split_call(args, self.batch_argnum, self.static_argnums)
        batch, extra = call.batch, call.extra
        check_call(call.state.tree, batch, extra)
        self._raise_if_scale_exhausted()
        self.check()
        micro_index = self._micro_index(call.state.tree)
        micro = self._is_micro(micro_index)
        jitted, shardings, log, batch = self._prepare(call, micro, args)
        check_placed(call.state.tree, shardings)
        with pmap_collectives_named(self.fn, self.zero.mesh.axis_names):
            out = jitted(call.state.tree, batch, *extra)
        self._last = log
        self._warn_if_not_hooked()
        if call.state.objects is not None:  # NNX: the objects take the new state, fn's return
            new_tree, out = out
            call.state.objects.update(call.objects, new_tree)
            step = None
        else:
            new_tree = out[0] if isinstance(out, tuple) else out
            step = getattr(new_tree, "step", None)
        cfg, opt = self.zero.config, zero_opt_state(new_tree)  # kept below: scalars, not state
        if cfg.accumulation_steps > 1:
            self._last_micro = weakref.ref(opt.micro)
            self._next_micro = (micro_index + 1) % cfg.accumulation_steps
        if cfg.scales_loss_dynamically:
            self._min_scale_flag = opt.overflow_at_min_scale
        if cfg.on_nonfinite != "off" and not self._is_micro(micro_index):
            self._nonfinite_flag = (opt.last_skipped, step, opt.skipped)
        return out

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
        if self.zero.config.on_nonfinite == "stop":
            raise ZeroError(
                f"{message}; stopping (on_nonfinite='stop'). The state that call "
                "returned is the last good one, unchanged by the bad step."
            )
        warn(f"zerojax: {message} ({int(total)} skipped so far; on_nonfinite='skip').")

    def trace(self, *args, micro: bool = False) -> jax.stages.Traced:
        """Trace the optimizer-step variant (or, with micro=True, the accumulate-only one):
        the usual jax `Traced`, with its `.jaxpr`."""
        with once_per(self.zero.warned):
            return self._trace(args, micro)

    def _trace(self, args, micro: bool) -> jax.stages.Traced:
        if (fitted := self._budgeted(args)) is not None:
            traced = fitted.trace(*args, micro=micro)
            self._last = fitted._last
            return traced
        call = split_call(args, self.batch_argnum, self.static_argnums)
        jitted, _, log, batch = self._prepare(call, micro, args)
        with pmap_collectives_named(self.fn, self.zero.mesh.axis_names):
            traced = jitted.trace(call.state.tree, batch, *call.extra)
        self._last = log
        self._warn_if_not_hooked()
        return traced

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
        cfg = self.zero.config
        if not cfg.manages_update:
            return 0
        opt = zero_opt_state(tree)
        if opt is None:
            raise ZeroError(
                "this zero_shard manages the update (precision, accumulation or "
                "clipping): create the state (or NNX objects) with zero.init(...) or "
                "zero.shard(...) so it carries the master weights and buffers."
            )
        if cfg.accumulation_steps == 1:
            return 0
        if self._last_micro is not None and self._last_micro() is opt.micro:
            return self._next_micro
        return int(opt.micro)  # a state from elsewhere: read its position once

    def _is_micro(self, micro_index: int) -> bool:
        return micro_index < self.zero.config.accumulation_steps - 1

    def _raise_if_scale_exhausted(self):
        if self._min_scale_flag is not None and bool(self._min_scale_flag):
            raise ZeroError(
                f"fp16 gradients still overflow with the loss scale at min_loss_scale="
                f"{self.zero.config.min_loss_scale}: training cannot proceed (the last state "
                "returned holds the last good parameters). Lower the learning rate, use "
                "precision='bf16', or lower min_loss_scale."
            )

    def _prepare(self, call: StepCall, micro: bool, args: tuple):
        """(jitted function, state shardings, its TraceLog, placed batch), compiled once per
        structure, shapes, argument order and variant; the checks that depend only on those
        (`args`: the user's call) run then, off the per-call path."""
        tree, objects, extra = call.state.tree, call.state.objects, call.extra
        batch = self.zero.place_batch(call.batch)
        key = (
            jax.tree_util.tree_structure((tree, batch, extra)),
            micro,
            call.order,
            None if objects is None else objects.graphdef,
            tuple(np.shape(x) for x in jax.tree_util.tree_leaves((tree, batch))),
        )
        if key not in self._jitted:
            check_arity(self.fn, len(args), ", ".join(type(a).__name__ for a in args))
            if self.zero.config.uses_host_memory and without_memories(self.zero.mesh.devices.flat):
                raise ZeroError(  # JAX would drop every memory kind: a step without offload
                    "this mesh's devices describe no memories (compile-only GPUs), so a step "
                    "lowered for them would keep everything on the device and offload nothing; "
                    "zero.report(step, state, batch) and `zerojax plan --topology` lower it on "
                    "CPU devices and compile it for these GPUs with its host memory."
                )
            if not self.zero.config.manages_update and zero_opt_state(tree) is not None:
                raise ZeroError(  # its optax would hand the gradients to nobody: no update
                    "this state holds master weights and buffers from a zero_shard that "
                    "manages the update (precision, accumulation or clipping), but this "
                    "zero_shard does not manage it. Decorate the step with the zero that made "
                    "the state (same precision, gradient_accumulation_steps, "
                    "gradient_clipping), or create the state with this zero's zero.init."
                )
            layout = self.zero.layout(tree)
            shardings = layout.shardings(self.zero.mesh)
            rows = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x)}
            log = TraceLog()
            fn = in_order(self.fn, call.order)
            if objects is None:
                traced = functools.partial(self._traced, fn, log, layout, shardings, rows, micro)
            else:
                traced = functools.partial(
                    self._traced_objects, fn, log, objects, layout, shardings, rows, micro
                )
            donate = (0,) if self.zero.config.donate else ()
            self._jitted[key] = (jax.jit(traced, donate_argnums=donate), shardings, log)
        return (*self._jitted[key], batch)

    # ---- tracing -----------------------------------------------------------------------------
    def _traced(self, fn, log, layout, shardings, batch_rows, micro, state, batch, *extra):
        cfg = self.zero.config
        log.calls.clear()  # a trace again (jax retraces) notes its calls afresh
        state = jax.lax.with_sharding_constraint(state, shardings)
        host_update = cfg.updates_on_host
        state = to_device(
            state, shardings, keep=(lambda p: category_of(p) == OPT_STATE) if host_update else None
        )
        if cfg.manages_update and present(state.opt_state.per_device):  # optim.prepare_state
            out = self._traced_local(fn, log, layout, shardings, micro, state, batch, *extra)
        else:
            out = self._traced_global(
                fn, log, layout, shardings, batch_rows, micro, state, batch, *extra
            )
        return finish(out, state, shardings, cast=cfg.uses_16bit and not micro)

    def _traced_objects(
        self, fn, log, objects, layout, shardings, batch_rows, micro, state, batch, *extra
    ):
        """NNX objects: `fn(objects, batch, *extra)` on objects merged from the placed dict
        state; the objects' calls on the batch run through the per-device hook, and a managed
        update is applied as for a TrainState (`flax.nnx_managed`)."""
        cfg = self.zero.config
        host_update = cfg.updates_on_host
        state = to_device(
            jax.lax.with_sharding_constraint(state, shardings),
            shardings,
            keep=(lambda p: category_of(p) == OPT_STATE) if host_update else None,
        )
        objs = objects.merge(state)
        log.calls.clear()  # a trace again (jax retraces) notes its calls afresh
        managed = None
        if cfg.manages_update:
            master = getattr(zero_opt_state(shardings), "master", ())
            layouts = (_device(shardings[PARAMS]), _device(master) if present(master) else None)
            managed = ManagedObjects(objs, cfg, micro, layouts)
        if managed and host_update and not micro:
            # the objects hold the state's arrays: their shardings found by identity
            by_id = {
                id(x): sh
                for x, sh in zip(*map(jax.tree_util.tree_leaves, (state, shardings)), strict=True)
            }
            opt = zero_opt_state(shardings)
            managed.run = self._host_optimizer(
                opt.master if present(opt.master) else shardings[PARAMS],
                jax.tree_util.tree_map(lambda x: by_id[id(x)], managed.inner),
                managed.params,
                layout,
            )
        hooked = contextlib.nullcontext()
        if self.zero.config.explicit_collectives:
            hook = self._hook(layout, batch_rows, log, managed and managed.scale)
            hooked = nnx_calls_hooked(hook, batch_rows, objs, objects.prefixes)
        with hooked, updating(managed.update) if managed else nullcontext([]) as updates:
            try:
                out = fn(objs, batch, *extra)
            except AttributeError as e:
                if not any(getattr(e, "obj", None) is o for o in objs):
                    raise
                raise ZeroError(
                    f"{getattr(self.fn, '__name__', 'the step')} reads `.{e.name}` of an NNX "
                    f"{type(e.obj).__name__}, as a step written for a Linen TrainState does. "
                    "Pass it a TrainState (step(state, batch)), or write it for NNX: "
                    "step(model, optimizer, batch), taking nnx.grad of the model and calling "
                    "optimizer.update(model, grads)."
                ) from None
        if managed and cfg.uses_16bit and not log.hooked:
            raise ZeroError(
                f"precision={cfg.precision!r} casts the parameters where the model runs per "
                f"device, which this step rules out: {self._fallback_reason()}. Train in "
                "fp32 (give the model a bf16 dtype for 16-bit compute)."
            )
        if managed:
            one_capture(updates)
            managed.finish()
        new = objects.to_state(objs)
        if not micro:
            new = {**new, PARAMS: _split_like_master(new[PARAMS], shardings)}
        return to_storage(new, shardings), out

    def _hook(self, layout, batch_rows, log, scale):
        """`hook(apply)`: `apply` run per device with the explicit collectives."""
        cfg, mesh, comm = self.zero.config, self.zero.mesh, self.zero.comm
        return lambda apply, stateful=None: hooked_apply_fn(
            apply, mesh, comm, cfg, layout, batch_rows, log, scale, stateful
        )

    def _traced_global(self, fn, log, layout, shardings, batch_rows, micro, state, batch, *extra):
        cfg = self.zero.config
        original = getattr(state, "apply_fn", None)
        managed = cfg.manages_update
        scale = state.opt_state.scale if managed and cfg.scales_loss else None
        view = state
        if managed:  # fp32 views laid out as the parameters are stored (not as the master)
            params = cast_floating(state.params, jnp.float32)
            view = view.replace(params=_constrain(params, shardings.params))
        explicit = self.zero.config.explicit_collectives
        hook = self._hook(layout, batch_rows, log, scale)
        if explicit and callable(original) and hasattr(state, "replace"):
            view = view.replace(apply_fn=hook(original))
        elif managed and cfg.uses_16bit:
            raise ZeroError(
                "16-bit precision casts parameters where state.apply_fn uses them, which the "
                "step does not do: keep explicit_collectives=True and call state.apply_fn in "
                "the step."
            )
        # a Linen model the step applies itself (a closure's model.apply) is hooked too
        hooked = linen_calls_hooked(hook, batch_rows) if explicit else contextlib.nullcontext()
        update = functools.partial(self._managed_update, layout, shardings, micro)
        with updating(update) if managed else nullcontext([]) as updates, hooked:
            out = fn((view,), batch, *extra)
        new_state, rest = split_output(out, state)
        if original is not None:
            new_state = new_state.replace(apply_fn=original)
        if not managed:
            return (new_state, *rest) if rest is not None else new_state
        one_capture(updates)
        new_state = new_state.replace(params=_split_like_master(new_state.params, shardings))
        return with_metrics(settle(state, new_state, cfg, micro), rest)

    def _managed_update(self, layout, shardings, micro, tx, grads, opt, params):
        """`ZeroTx.update` inside the step: `optim.managed_update`, with the optimizer on the
        device or (offload_update='host') on the host CPU."""
        if not isinstance(opt, ZeroOptState):
            raise ZeroError(
                "a managed zerojax step's apply_gradients must call tx.update with the "
                f"state's own opt_state; it passed {type(opt).__name__}."
            )
        cfg, run = self.zero.config, None
        if cfg.updates_on_host and not micro:
            sh = shardings.opt_state
            master = sh.master if present(sh.master) else shardings.params
            run = self._host_optimizer(master, sh.inner, params, layout)
        return managed_update(tx, opt, grads, params, cfg, micro, run)

    def _update(self, layout, shardings, new_state, old_step, grads):
        """`optim.apply_update` (local accumulation), on the device or on the host CPU."""
        cfg, run = self.zero.config, None
        if cfg.updates_on_host:
            opt = shardings.opt_state
            master = opt.master if present(opt.master) else shardings.params
            run = self._host_optimizer(master, opt.inner, new_state.params, layout)
        return apply_update(new_state, old_step, grads, cfg, run)

    def _host_optimizer(self, master, inner, params, layout):
        """`run_optimizer` of `optim.apply_update` for offload_update='host': the user's optax
        step on the host CPU. `master`, `inner`: their storage shardings; the gradients travel
        split like the master (`params`' sharded specs)."""
        mesh = self.zero.mesh
        grads = jax.tree_util.tree_map(
            lambda spec: NamedSharding(mesh, spec),
            layout.param_specs(params, "sharded_spec"),
            is_leaf=lambda x: isinstance(x, P),
        )
        host = (master, inner, grads, NamedSharding(mesh, P()))
        return functools.partial(optimizer_on_host, shardings=host)

    def _traced_local(self, fn, log, layout, shardings, micro, state, batch, *extra):
        cfg, mesh, comm = self.zero.config, self.zero.mesh, self.zero.comm
        # the step runs per device on its parameters' and optimizer state's storage layout,
        # and on whole other fields (an EMA split at rest is gathered for it)
        specs = jax.tree_util.tree_map_with_path(
            lambda p, s: s.spec if category_of(p) in (PARAMS, OPT_STATE) else P(), shardings
        )
        param_grad_specs = layout.param_specs(state.params, "grad_spec")
        body = functools.partial(local_body, fn, cfg, comm, param_grad_specs, log, micro)
        batch_specs = jax.tree_util.tree_map(
            lambda x: P(comm.data_axis) if np.ndim(x) else P(), batch
        )
        new_state, reduced, rest = manual_over_data(
            body,
            mesh,
            comm,
            (specs, batch_specs, P()),
            (specs, param_grad_specs if not micro else P(), P()),
            check_vma=False,
        )(state, batch, extra)
        if micro:
            new_state = new_state.replace(opt_state=accumulate(new_state.opt_state, ()))
        else:
            new_state = self._update(layout, shardings, new_state, state.step, reduced)
        return with_metrics(new_state, rest)

    def _fallback_reason(self) -> str:
        """Why the last traced step placed no explicit collectives."""
        if not self.zero.config.explicit_collectives:
            return "explicit_collectives=False"
        return (
            f"{getattr(self.fn, '__name__', 'the step')} does not call state.apply_fn, a "
            "Linen model's apply or an NNX model it receives on the batch"
        )

    def _warn_if_not_hooked(self):
        cfg = self.zero.config
        if not (cfg.explicit_collectives and cfg.shards_gradients):
            return
        if self.used_explicit_collectives is False:
            cost = (
                "stage 3 then gathers the parameters where XLA chooses, not unit by unit, so "
                "the peak holds many layers' weights"
                if cfg.shards_parameters
                else f"on CPU, stage {cfg.stage} then all-reduces the gradients instead of "
                "reduce-scattering them"
            )
            warn(
                f"zerojax: {self._fallback_reason()}, so XLA's partitioner places every "
                f"collective, ZeRO's included ({cost})."
            )


def _device(shardings):
    """`shardings`' splits, in device memory."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(s.mesh, s.spec), shardings)


def _split_like_master(params, shardings):
    """The new 16-bit `params` split like the fp32 master weights (as stages 1-2 split the
    optimizer state), so that what the next step gathers is the 16-bit copy, not fp32
    updates; `params` as they are without a master."""
    master = getattr(zero_opt_state(shardings), "master", ())
    if not present(master) or not same_structure(params, master):
        return params
    return _constrain(params, master)


def _constrain(tree, shardings):
    """`tree` laid out like `shardings` (their split, in device memory)."""
    return jax.lax.with_sharding_constraint(tree, _device(shardings))


@contextlib.contextmanager
def pmap_collectives_named(fn, mesh_axes: tuple):
    """A step or model written for `jax.pmap` (a `lax.pmean` over its axis name, as Flax's
    imagenet example's step; a layer given `axis_name=`, as its BatchNorm) fails with a
    ZeroError saying what to change, not jax's unbound-axis NameError (outside the per-device
    model) or its bare AssertionError (inside it, on an axis the mesh does not have)."""
    try:
        yield
    except NameError as e:
        match = re.search(r"unbound axis name: (\S+?)\.", str(e))
        if match is None:
            raise
        raise ZeroError(
            f"{getattr(fn, '__name__', 'the step')} reduces over the axis {match[1]!r} "
            "(lax.pmean / lax.psum), as a step written for jax.pmap does. A zerojax step is "
            "one program over the global batch whose gradients zerojax reduces, as under "
            "jax.jit: remove the collective (its gradients and metrics are global already)."
        ) from None
    except AssertionError as e:
        missing = _axes_not_in_mesh(e, mesh_axes)
        if not missing:
            raise
        raise ZeroError(
            f"the model reduces over the axis {missing[0]!r}, which the mesh does not have: "
            "a layer given axis_name= for jax.pmap, as Flax's BatchNorm(axis_name='batch') in "
            "its imagenet example. The model runs once per device on zerojax's data axis: name "
            f"that axis after the layer's, zero_shard(..., axis={missing[0]!r}), and it reduces "
            "over all devices as under jax.pmap (or drop axis_name= to keep each device's own)."
        ) from None


def _axes_not_in_mesh(error: AssertionError, mesh_axes: tuple) -> list:
    """The axis names not in `mesh_axes` that the innermost frame naming an `axis_name` (a
    collective's caller: Flax's normalisation layers, a user's `lax.pmean(x, axis_name)`)
    passed, when jax's assertion failed under it; empty when none does (another assertion).
    JAX drops its own frames from the traceback, so the caller's are what is left to read."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        name = frame.f_locals.get("axis_name")
        names = (name,) if isinstance(name, str) else name
        if isinstance(names, tuple) and all(isinstance(n, str) for n in names):
            return [n for n in names if n not in mesh_axes]
    return []
