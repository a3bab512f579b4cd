"""`zero_shard`: one object that places a train state by the ZeRO rules and jits the step.

    zero = zero_shard(stage=3)
    state = zero.init(init_fn, key)      # born sharded
    @zero
    def train_step(state, batch): ...    # unchanged single-device step
"""
from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.config import ZeroError, ZeroConfig, resolve_config
from zerojax.hook import hooked_apply_fn
from zerojax.mesh import make_mesh
from zerojax.rules import plan_state, path_str


def zero_shard(stage: int | None = None, *, mesh=None, config=None, **options) -> "ZeroShard":
    """A ZeroShard from `config` (ZeroConfig, DeepSpeed JSON path or dict) with keyword options
    (`stage` included) overriding it; `mesh` defaults to all devices on the config's axis."""
    if stage is not None:
        options["stage"] = stage
    return ZeroShard(resolve_config(config, **options), mesh)


class ZeroShard:
    """Sharding rules for one mesh and config, and the decorator that applies them to a step."""

    def __init__(self, config: ZeroConfig, mesh=None):
        self.config = config
        self.mesh = make_mesh(axis=config.axis) if mesh is None else mesh
        if config.axis not in self.mesh.axis_names:
            raise ZeroError(f"the mesh has axes {self.mesh.axis_names}, not the config's axis "
                              f"{config.axis!r}; pass axis= to match the mesh.")
        self.axis_size = self.mesh.shape[config.axis]

    def __repr__(self):
        return f"ZeroShard(stage={self.config.stage}, mesh={dict(self.mesh.shape)})"

    # ---- placement -------------------------------------------------------------------------
    def plan(self, state):
        """Per-leaf `LeafPlan`s (path, category, spec, reason) for `state` or its abstract shape."""
        return plan_state(state, self.config, self.axis_size)[1]

    def state_shardings(self, state):
        """A pytree of NamedShardings, one per leaf of `state`, saying where each leaf lives."""
        specs = plan_state(state, self.config, self.axis_size)[0]
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                      is_leaf=lambda x: isinstance(x, P))

    def shard(self, state):
        """`state` placed by the rules (a copy; the input is left as it was)."""
        return jax.device_put(state, self.state_shardings(state))

    def init(self, init_fn, *args, **kwargs):
        """Run `init_fn(*args, **kwargs)` under jit with sharded outputs: the state is created
        shard by shard and never exists whole on one device."""
        abstract = jax.eval_shape(init_fn, *args, **kwargs)
        return jax.jit(init_fn, out_shardings=self.state_shardings(abstract))(*args, **kwargs)

    def batch_sharding(self, leaf) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.config.axis) if np.ndim(leaf) else P())

    def place_batch(self, batch):
        """Each batch leaf split on its leading dim over the axis (scalars replicated). In a
        multi-process run each process passes its own slice of the global batch."""
        multiprocess = jax.process_count() > 1
        def place(path, leaf):
            if not hasattr(leaf, "shape"):
                leaf = np.asarray(leaf)
            sharding = self.batch_sharding(leaf)
            if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
                return leaf
            rows = np.shape(leaf)[0] * (jax.process_count() if multiprocess else 1) \
                if np.ndim(leaf) else 0
            if rows % self.axis_size:
                raise ZeroError(
                    f"batch leaf {path_str(path) or '(root)'} has {rows} rows (shape "
                    f"{np.shape(leaf)}), which does not divide by the {self.axis_size} devices "
                    f"of axis {self.config.axis!r}: use a global batch that is a multiple of "
                    f"{self.axis_size}.")
            if multiprocess and np.ndim(leaf):
                return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))
            return jax.device_put(leaf, sharding)
        return jax.tree_util.tree_map_with_path(place, batch)

    # ---- the step --------------------------------------------------------------------------
    def __call__(self, step_fn):
        """Decorate `step_fn(state, batch, *extra) -> new_state or (new_state, ...)`."""
        return ZeroStep(self, step_fn)

    def report(self, step, state, batch, *extra):
        """Compiled memory and communication of `step` on these inputs (see zerojax.report)."""
        from zerojax.report import build_report
        return build_report(self, step, state, batch, *extra)


class ZeroStep:
    """A zerojax train step: a `jax.jit` function with the state's shardings, donation and
    batch placement. `.lower(state, batch)` gives the usual jax `Lowered` for inspection."""

    def __init__(self, zero: ZeroShard, fn):
        self.zero, self.fn = zero, fn
        self._jitted = {}
        self.used_explicit_collectives = None  # known after the first trace
        self._warned = False
        functools.update_wrapper(self, fn)

    def _prepare(self, state, batch, extra):
        """(jitted function, state shardings, placed batch), compiled once per state layout."""
        batch = self.zero.place_batch(batch)
        key = (jax.tree_util.tree_structure((state, batch, extra)),
               tuple(np.shape(x) for x in jax.tree_util.tree_leaves((state, batch))))
        if key not in self._jitted:
            shardings = self.zero.state_shardings(state)
            rows = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x)}
            jitted = jax.jit(functools.partial(self._traced, shardings, rows),
                             donate_argnums=(0,) if self.zero.config.donate else ())
            self._jitted[key] = (jitted, shardings)
        return (*self._jitted[key], batch)

    def _traced(self, shardings, batch_rows, state, batch, *extra):
        cfg, mesh = self.zero.config, self.zero.mesh
        state = jax.lax.with_sharding_constraint(state, shardings)
        original = getattr(state, "apply_fn", None)
        calls = []
        if cfg.explicit_collectives and callable(original) and hasattr(state, "replace"):
            state = state.replace(apply_fn=hooked_apply_fn(original, mesh, cfg, batch_rows, calls))
        out = self.fn(state, batch, *extra)
        self.used_explicit_collectives = bool(calls)
        return _constrain_new_state(out, state, original, shardings)

    def _warn_if_not_hooked(self):
        if (self.zero.config.explicit_collectives and self.used_explicit_collectives is False
                and self.zero.config.stage >= 2 and not self._warned):
            self._warned = True
            warnings.warn(f"zerojax: {self.__name__} does not call state.apply_fn, so XLA's "
                          "partitioner places the collectives (on CPU, stage 2 then all-reduces "
                          "the gradients instead of reduce-scattering them).", stacklevel=3)

    def __call__(self, state, batch, *extra):
        jitted, shardings, batch = self._prepare(state, batch, extra)
        _check_placed(state, shardings)
        out = jitted(state, batch, *extra)
        self._warn_if_not_hooked()
        return out

    def lower(self, state, batch, *extra):
        jitted, _, batch = self._prepare(state, batch, extra)
        lowered = jitted.lower(state, batch, *extra)
        self._warn_if_not_hooked()
        return lowered


def _check_placed(state, shardings):
    """Fail with a clear message (not an XLA device mismatch) if `state` was not placed by zero."""
    for (path, leaf), want in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                  jax.tree_util.tree_leaves(shardings)):
        have = getattr(leaf, "sharding", None)
        if have is None or not have.is_equivalent_to(want, np.ndim(leaf)):
            raise ZeroError(
                f"state leaf {path_str(path)} is not placed as this zero_shard expects (it has "
                f"{have}, expected {want.spec} on the mesh): create the state with zero.init(...) "
                "or place it with zero.shard(state).")


def _constrain_new_state(out, state, original_apply_fn, shardings):
    """Pin the returned state (alone, or first of a tuple) to the storage shardings."""
    def fix(new):
        if original_apply_fn is not None and hasattr(new, "apply_fn"):
            new = new.replace(apply_fn=original_apply_fn)
        if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(shardings):
            return None
        return jax.lax.with_sharding_constraint(new, shardings)

    if type(out) is type(state) and (fixed := fix(out)) is not None:
        return fixed
    if isinstance(out, tuple) and out and type(out[0]) is type(state):
        if (fixed := fix(out[0])) is not None:
            return (fixed, *out[1:])
    raise ZeroError("a zerojax step must return the new state, or a tuple whose first item "
                      f"is the new state, with the same structure as the input state "
                      f"({type(state).__name__}).")
