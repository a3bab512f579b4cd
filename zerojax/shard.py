"""`zero_shard`: one object that places a train state by the ZeRO rules and jits the step.

zero = zero_shard(stage=3)
state = zero.init(init_fn, key)      # born sharded
@zero
def train_step(state, batch): ...    # unchanged single-device step
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.comm.offload import to_storage
from zerojax.core.config import ZeroConfig, resolve_config
from zerojax.core.errors import ZeroError, warn
from zerojax.core.rules import LeafPlan, StateLayout, params_by_path, plan_state, with_units
from zerojax.engine.checks import check_init_fn
from zerojax.engine.placement import Placement, inert_options, place_batch
from zerojax.engine.state import Boundary, boundary, managed
from zerojax.engine.step import ZeroStep
from zerojax.flax import stacks
from zerojax.flax.annotations import carried_tensor_specs, read_linen_boxes
from zerojax.flax.nnx import nnx_building
from zerojax.inspect.describe import Description, describe, replication_warnings

if TYPE_CHECKING:
    from zerojax.inspect.report import Report

PyTree = Any  # a train state, batch or any nest of arrays


def zero_shard(
    stage: int | None = None, *, mesh=None, config=None, strict: bool = True, **options
) -> ZeroShard:
    """A ZeroShard from `config` (ZeroConfig, DeepSpeed JSON path or dict) with keyword options
    (`stage` included) overriding it; `mesh` defaults to all devices on the config's axis.
    `strict=False` warns about unknown DeepSpeed keys instead of refusing them."""
    if stage is not None:
        options["stage"] = stage
    return ZeroShard(resolve_config(config, strict=strict, **options), mesh)


class ZeroShard:
    """Sharding rules for one mesh and config, and the decorator that applies them to a step."""

    def __init__(self, config: ZeroConfig, mesh=None):
        # resolved once: batch sizes and 'auto' for this mesh, its Comm, the policy views
        self.placement = Placement.resolve(config, mesh)
        self.mesh, self.comm = self.placement.mesh, self.placement.comm
        self.axis_size = self.comm.data_size  # devices that split the batch
        self.shard_size = self.comm.shard_size  # devices that split the state
        self.config = self.placement.config
        # a pure cache of `layout`, keyed by structure; nothing else is kept between calls
        self._layouts: dict[tuple, StateLayout] = {}
        idle = inert_options(config, self.placement)
        if idle:
            warn(
                "zerojax: "
                + "; ".join(
                    f"{name}={getattr(config, name)!r} does nothing {why}"
                    for name, why in idle.items()
                )
                + ". Leave them at their defaults, or change what they depend on.",
                self.warned,
            )

    @property
    def warned(self) -> set:
        """The causes this zero has warned about, each said once (its placement's)."""
        return self.placement.warned

    def __repr__(self):
        return f"ZeroShard(stage={self.config.stage}, mesh={dict(self.mesh.shape)})"

    # ---- placement -------------------------------------------------------------------------
    def layout(self, state: PyTree) -> StateLayout:
        """Every leaf's `LeafPlan` for `state` (a train state, its abstract shape, or NNX
        objects: their dict state), computed once per leaf paths, shapes, dtypes and the
        model's tensor-parallel layout, then cached: the one place a leaf's layout is decided."""
        return self._step_layout(state)

    def _step_layout(self, state: PyTree, stacks: frozenset | None = None) -> StateLayout:
        """`layout(state)`; `stacks`, the stacked parameters a step's calls revealed for a
        state whose layout nothing had described (`ZeroStep`), decide it from then on."""
        user = boundary(state)
        return self._layout(read_linen_boxes(user.tree, self.mesh, self.config)[0], user, stacks)

    def _layout(self, tree, user: Boundary, stacks: Collection | None = None) -> StateLayout:
        """The layout of `tree` (`user`'s state, or what `manage` made of it) for the
        tensor-parallel layout `user` declares; `stacks`: the stacked parameters as Flax built
        them (`flax.stacks`, from `init`) or a step's calls revealed them, which decide the
        layout of every state of this structure from then on. Until something has said,
        the layout is provisional: no stacks (`StateLayout.stacks` None), never a guess."""
        tensor = self._declared(user)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        key = (
            tuple((jax.tree_util.keystr(p), np.shape(x), str(x.dtype)) for p, x in leaves),
            tuple(sorted(tensor.items())),
        )
        known = self._layouts[key].stacks if key in self._layouts else None
        if key not in self._layouts or (stacks is not None and frozenset(stacks) != known):
            self._layouts[key] = plan_state(tree, self.config, self.shard_size, tensor, stacks)
            causes = replication_warnings(
                self._layouts[key].plans, self.config, self.shard_size, jax.device_count()
            )
            for cause, message in causes.items():
                warn(message, self.warned, cause)
        cached = self._layouts[key]
        # a state of another TrainState instance (its apply_fn, tx) has the same plans
        return cached if cached.treedef == treedef else dataclasses.replace(cached, treedef=treedef)

    def _declared(self, user: Boundary) -> dict:
        """{parameter path: TensorSpec}: the tensor-parallel layout the state itself declares
        (NNX sharding metadata, Linen boxes) or, placed or abstract, carries in its shardings."""
        return (
            user.tensor_specs(self.mesh, self.config)
            or read_linen_boxes(user.tree, self.mesh, self.config)[1]
            or carried_tensor_specs(user.tree, self.mesh, self.config)
        )

    def plan(
        self,
        state: PyTree,
        *,
        step: ZeroStep | None = None,
        batch=None,
        step_args: tuple | None = None,
    ) -> list[LeafPlan]:
        """Per-leaf `LeafPlan`s (path, category, spec, reason) for `state` or its abstract shape
        (NNX objects: for their dict state, see zerojax.flax.nnx). Given the `step` and a
        `batch` (a `step(state, batch)`, or `step(*objects, batch)`), or `step_args`, the
        step's arguments as it is called (another order, or arguments after the batch), each
        parameter also names its unit (found by tracing the step)."""
        if step is None:
            return list(self.layout(state).plans)
        units = step.units_of(*_step_args(state, batch, step_args))  # may tell where stacks are
        return with_units(list(self.layout(state).plans), units)

    def state_shardings(self, state: PyTree) -> PyTree:
        """A pytree of NamedShardings, one per leaf of `state`, saying where each leaf lives
        (NNX objects: one per leaf of their dict state `{params, opt_state, other}`)."""
        return self.layout(state).shardings(self.mesh)

    def manage(self, state: PyTree) -> PyTree:
        """`state` as this config trains it, without the model's partitioning boxes: with
        precision, accumulation or clipping on, 16-bit params plus a `ZeroOptState` (master
        weights, buffers); otherwise unchanged. NNX objects: new managed objects."""
        user = boundary(state)
        held = self._managed(user, user.tree)
        return held.rebuild(held.tree)

    def _managed(self, user: Boundary, tree) -> Boundary:
        tree = read_linen_boxes(tree, self.mesh, self.config)[0]
        return managed(user, tree, self.placement.update, self.axis_size)

    def abstract(self, state: PyTree) -> PyTree:
        """`state` (a train state or its abstract shape; NNX objects: their dict state) as this
        zero holds it: managed, as ShapeDtypeStructs carrying their shardings."""
        return self.holding(state)[0]

    def holding(self, state: PyTree, built: dict | None = None) -> tuple[PyTree, Boundary]:
        """(`abstract(state)`, the boundary whose `rebuild` turns such a tree into the user's
        kind of state: for NNX objects, managed objects like them). `built`: what
        `flax.stacks.recording` saw while `state` was made (its stacked parameters)."""
        user, seen = boundary(state), []

        def manage(tree):
            seen.append(self._managed(user, tree))
            return seen[-1].tree

        tree = jax.eval_shape(manage, user.tree)
        stacked = stacks.stacked(built or {}, params_by_path(user.tree))
        shardings = self._layout(tree, user, stacked).shardings(self.mesh)  # user: its TP
        abstract = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )
        return abstract, seen[-1]

    def shard(self, state: PyTree) -> PyTree:
        """`state` managed and placed by the rules (a copy; the input is left as it was). NNX
        objects (one, or a tuple) come back as new objects holding the placed state."""
        user = boundary(state)
        abstract, held = self.holding(state)
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
        tree = read_linen_boxes(user.tree, self.mesh, self.config)[0]
        mesh_devices = set(self.mesh.devices.flat)
        elsewhere = lambda x: isinstance(x, jax.Array) and x.sharding.device_set != mesh_devices
        if any(elsewhere(x) for x in jax.tree_util.tree_leaves(tree)):  # e.g. built on one device
            tree = jax.tree_util.tree_map(
                lambda x, s: jax.device_put(x, s.with_memory_kind("device")) if elsewhere(x) else x,
                tree,
                self._layout(jax.eval_shape(lambda t: t, tree), user).shardings(self.mesh),
            )
        placed = jax.jit(lambda t: self._managed(user, t).tree, out_shardings=shardings)(tree)
        self._check_logical_rules_used(self._declared(user))
        return held.rebuild(placed)

    def init(self, init_fn: Callable[..., PyTree], *args, **kwargs) -> PyTree:
        """Run `init_fn(*args, **kwargs)` under jit with sharded outputs: the state is created
        shard by shard and never exists whole on one device."""
        check_init_fn(init_fn, args, kwargs)
        seen = []  # the traced state's boundary (to rebuild the user's kind) and its TP layout

        def make(*a, **k):  # traced once: init_fn may build a new model object per call
            with nnx_building(), stacks.recording() as built:
                user = boundary(init_fn(*a, **k))
                declared, held = self._declared(user), self._managed(user, user.tree)
            seen.append((held, declared))
            state = jax.tree_util.tree_map(jnp.asarray, held.tree)
            stacked = stacks.stacked(built, params_by_path(user.tree))
            return to_storage(state, self._layout(state, user, stacked).shardings(self.mesh))

        state = jax.jit(make)(*args, **kwargs)
        held, declared = seen[-1]
        self._check_logical_rules_used(declared)
        return held.rebuild(state)

    def _check_logical_rules_used(self, declared: dict):
        if self.config.logical_rules and not declared:
            warn(
                "zerojax: logical_rules has nothing to map: the model declares no "
                "partitioning (nn.with_logical_partitioning, nnx.with_partitioning), "
                "so only ZeRO's axis splits the state.",
                self.warned,
            )

    def eval_shape(self, init_fn: Callable[..., PyTree], *args, **kwargs) -> PyTree:
        """The state `init` would create, as ShapeDtypeStructs carrying their shardings: lower,
        compile and report a step for a model too large to allocate (nothing is allocated).
        NNX objects come back as abstract objects whose variables hold them."""
        with nnx_building():
            with stacks.recording() as built:
                made = jax.eval_shape(init_fn, *args, **kwargs)
            abstract, held = self.holding(made, built)
            return held.rebuild(abstract)

    def place_batch(self, batch: PyTree) -> PyTree:
        """Each batch leaf split on its leading dim over the axis (scalars replicated). In a
        multi-process run each process passes its own slice of the global batch."""
        return place_batch(self.placement, batch)

    # ---- the step --------------------------------------------------------------------------
    def __call__(
        self, step_fn=None, *, batch_argnum: int | None = None, static_argnums: tuple = ()
    ):
        """Decorate `step_fn(state, batch, *extra) -> new_state or (new_state, ...)`, or an
        NNX step taking its objects anywhere (`step(model, optimizer, rngs, batch, metrics)`).
        The batch is the first argument that is not the state or an NNX object;
        `batch_argnum` names its position where that is not so. `static_argnums`: arguments
        that stay Python values, as `jax.jit`'s (a config, a learning-rate function). Either
        `zero(step, static_argnums=(2, 3))` or `@zero(static_argnums=(2, 3))`."""
        if step_fn is None:
            return functools.partial(
                self.__call__, batch_argnum=batch_argnum, static_argnums=static_argnums
            )
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        statics = tuple(static_argnums)
        step_fn = _unjitted(step_fn)

        def compile_and_report(keep_gathered: tuple, args: tuple):
            """memory_budget's trial: the step with `keep_gathered`, and its report."""
            config = self.config.replace(memory_budget=0, keep_gathered=keep_gathered)
            variant = ZeroShard(config, self.mesh)
            step = variant(step_fn, batch_argnum=batch_argnum, static_argnums=statics)
            return step, variant.report(step, *args)

        return ZeroStep(
            self.placement,
            step_fn,
            self._step_layout,
            batch_argnum=batch_argnum,
            static_argnums=statics,
            fit=compile_and_report,
        )

    def load_safetensors(self, state: PyTree, path: str, *, names=None, transpose=None) -> PyTree:
        """`state` with its parameters read from a Hugging Face style safetensors file, each
        device reading only its own slice (see zerojax.io.interop)."""
        from zerojax.io.interop import load_safetensors

        user = boundary(state)  # NNX objects: new objects holding the loaded state
        return user.rebuild(
            load_safetensors(self, user.tree, path, names=names, transpose=transpose)
        )

    def describe(
        self,
        state: PyTree,
        *,
        tolerance: float | None = None,
        show: bool = True,
        step: ZeroStep | None = None,
        batch=None,
        step_args: tuple | None = None,
    ) -> Description:
        """Print (unless `show=False`) and return a table of every leaf of `state` (a train
        state, its abstract shape, or NNX objects): path, shape, dtype, spec, memory kind,
        bytes per device, and (given the `step` and a `batch` or `step_args`, as `plan`
        takes them) each parameter's unit.
        Raises ZeroError when more than `tolerance` (a fraction, e.g. 0.02) of the bytes this
        stage splits stays replicated (why was said when the zero first planned the state).
        See zerojax.inspect.describe."""
        units = {}
        if step is not None:
            plans = self.plan(state, step=step, batch=batch, step_args=step_args)
            units = {p.path: p.unit for p in plans if p.unit}
        out = describe(self, boundary(state).tree, tolerance, units)
        if show:
            print(out, end="")
        return out

    def report(
        self, step: ZeroStep, state: PyTree, batch: PyTree, *extra, dump_to: str | None = None
    ) -> Report:
        """Compiled memory and communication of `step` on these inputs (see zerojax.inspect.report);
        `dump_to`, a path prefix, also writes the partitioned and optimized HLO."""
        from zerojax.inspect.report import build_report

        return build_report(self, step, state, batch, *extra, dump_to=dump_to)


def _step_args(state, batch, step_args) -> tuple:
    """The arguments `plan` and `describe` trace the step with: `step_args` as given, or the
    state (or NNX objects) followed by `batch`."""
    if step_args is not None:
        if batch is not None:
            raise ZeroError(
                "pass the step's arguments once: step_args=(...) holds the batch too, so drop "
                "batch=."
            )
        return tuple(step_args)
    if batch is None:
        raise ZeroError(
            "naming units traces the step, which needs its arguments: pass batch= (for "
            "step(state, batch)) or step_args=(...) (its arguments in its order, e.g. "
            "step_args=(state, batch, config, rng))."
        )
    objects = state if isinstance(state, tuple) and boundary(state).objects else (state,)
    return (*objects, batch)


def _unjitted(step_fn):
    """The Python function inside a step already decorated with `jax.jit` or `nnx.jit`, with a
    warning: zerojax compiles the step itself, with its own shardings and donation, so the
    decorator's options (static_argnums, donate_argnums, shardings) do not apply, and a static
    argument it named would reach the step traced."""
    inner = getattr(step_fn, "__wrapped__", None)
    if inner is None or not hasattr(step_fn, "lower"):
        return step_fn
    name = getattr(inner, "__name__", "the step")
    warn(
        f"zerojax: {name} is already a jax.jit (or nnx.jit) function; zerojax compiles the "
        f"step itself and takes the function inside it ({name}.__wrapped__): the jit's options "
        "do not apply. Pass its static arguments as zero(step, static_argnums=...); zerojax "
        "donates the state itself. Decorate the plain function with @zero to silence this."
    )
    return inner
