"""Canaries for the private names of jax that zerojax uses (each where no public API
does the same job) and for the compiler behaviours its design rests on: when a dependency
changes one, this fails with what to change, instead of export, restore or the XLA-flag
defaults failing deep inside, or a cheaper way going unnoticed."""

import sys

import jax
import numpy as np

import zerojax  # noqa: F401  (imports jax's backend module)


def test_prng_key_dtypes_name_their_implementation():
    dtype = jax.ShapeDtypeStruct((), jax.random.key(0).dtype).dtype
    impl = getattr(dtype, "_impl", None)
    assert impl is not None, (
        "a typed PRNG key dtype no longer has `_impl`: zerojax.io.checkpoint._place rebuilds "
        "restored keys with jax.random.wrap_key_data(data, impl=dtype._impl); take the "
        "implementation from the abstract target another way there."
    )
    key = jax.random.wrap_key_data(jax.random.key_data(jax.random.key(3)), impl=impl)
    assert jax.random.key_data(key).tolist() == jax.random.key_data(jax.random.key(3)).tolist()


def test_jax_backend_registry_is_where_zerojax_looks():
    bridge = sys.modules.get("jax._src.xla_bridge")
    assert bridge is not None and isinstance(getattr(bridge, "_backends", None), dict), (
        "jax._src.xla_bridge._backends moved: zerojax.core.xla_flags.apply_defaults reads it "
        "to know "
        "whether JAX's backend started before zerojax set its XLA flags; find the new registry."
    )
    jax.devices()
    assert bridge._backends  # filled once a backend has started


def test_shard_map_values_say_which_axes_they_vary_over():
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    seen = []

    def body(x, y):
        seen.append((jax.typeof(x).mat.varying, jax.typeof(y).mat.varying))
        return x + y.sum()

    run = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    jax.jit(run).trace(np.zeros(jax.device_count(), np.float32), np.zeros(3, np.float32))
    assert seen == [(frozenset({"data"}), frozenset())], (
        "jax.typeof(x).mat.varying no longer names the manual axes a value varies over: "
        "zerojax.comm.device_values.varying reads it to cast a unit's whole leaves to per-device "
        f"values only over the axes they do not vary over yet (got {seen}); find its new name."
    )


def test_flax_rng_counters_nest_per_child_scope():
    import inspect

    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)

    bound = Net().bind({}, rngs={"dropout": jax.random.key(0)})
    bound(np.ones(4, np.float32))
    nested = {
        key[1]: value for key, value in bound.scope.rng_counters.items() if isinstance(key, tuple)
    }
    assert nested.get("Dropout_0") == {"dropout": 1}, (
        "flax.core.scope.Scope.rng_counters no longer keeps each child's counters in a nested "
        "dict keyed (sentinel, child name): zerojax.flax.unit_calls.gather_unit copies a unit's "
        "counters into the scope it applies the unit in, so its submodules draw the keys they "
        f"would draw bound; find where Flax keeps them now (got {bound.scope.rng_counters})."
    )
    assert "_deep_clone" in inspect.signature(nn.Module.clone).parameters, (
        "flax.linen.Module.clone lost `_deep_clone`: zerojax.flax.unit_calls.gather_unit clones a "
        "unit onto its scope the way Module.apply does; follow Module.apply's new way there."
    )


def test_a_trace_context_option_makes_jit_trace_again():
    from jax._src import config as jax_config

    state = getattr(jax_config, "hlo_source_file_canonicalization_regex", None)
    traces = []

    @jax.jit
    def inner(x):
        traces.append(1)
        return x * 2

    inner(np.ones(3, np.float32))
    with state("(?!)zerojax-canary"):
        jax.eval_shape(inner, np.ones(3, np.float32))
    assert len(traces) == 2, (
        "jax._src.config.hlo_source_file_canonicalization_regex no longer keys jit's trace "
        "cache: zerojax.engine.hook.fresh_traces sets it so that a model's own jax.jit "
        "(Flax's nn.jit) "
        "traces again where zerojax finds and gathers units; pick another trace-context option "
        "that changes nothing a trace computes."
    )


def test_every_elementwise_primitive_is_redone_by_a_units_backward():
    # what other tests import registers primitives too: import it here, so that the set is the
    # same whatever ran before
    import jax.experimental.multihost_utils  # noqa: F401
    import jax.numpy  # noqa: F401
    from jax._src.interpreters import batching

    from zerojax.flax.unit_calls import _REDONE_IN_BACKWARD

    elementwise = (batching.vectorized_batcher, batching.broadcast_batcher)
    found = {
        prim.name
        for prim, rule in batching.fancy_primitive_batchers.items()
        if getattr(rule, "func", None) in elementwise
    }
    assert len(found) > 50, (
        "jax._src.interpreters.batching no longer marks elementwise primitives by their batching "
        "rule; find another way to list them for this check"
    )
    not_arithmetic = {"global_array_to_host_local_array"}  # multihost_utils' host transfer
    missing = sorted(found - _REDONE_IN_BACKWARD - not_arithmetic)
    assert not missing, (
        "jax has elementwise primitives zerojax.flax.unit_calls._ELEMENTWISE does not list: "
        f"{missing}."
        " A unit would keep their outputs for backward (memory, not wrong results): add them."
    )


def test_xla_cpu_drops_an_optimization_barriers_ordering():
    # zerojax.flax.unit_calls._depend ties a unit's gather to its anchor with an add of zero per
    # leaf (a kernel each: 0.5 s of the bench LM's stage-3 compile, BENCHMARKS "Compile
    # time"), not with jax.lax.optimization_barrier, because XLA:CPU schedules a barrier's
    # gathers as if it were not there: all up front, each layer's weights alive at once
    import re

    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    ties = {
        "none": lambda w, a: w,
        "add": lambda w, a: w + 0 * a,  # what _depend does
        "barrier": lambda w, a: jax.lax.optimization_barrier((w, a))[0],
    }

    def schedule(tie):
        def body(ws, x):
            for w in ws:  # each layer's gather tied to the previous layer's output
                x = jnp.tanh(x @ jax.lax.all_gather(tie(w, x.reshape(-1)[0]), "data", tiled=True))
            return x

        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        rows = jax.ShapeDtypeStruct(
            (256, 256), jnp.float32, sharding=NamedSharding(mesh, P("data"))
        )
        compiled = run.lower([rows] * 4, rows).compile()
        entry = compiled.as_text().split("ENTRY")[1]
        gathers = [m.start() for m in re.finditer(r" all-gather\(", entry)]
        fused = [m.start() for m in re.finditer(r" fusion\(", entry)]
        gathered_ahead = sum(g < min(fused) for g in gathers)  # gathers before any compute
        return gathered_ahead, compiled.memory_analysis().temp_size_in_bytes

    got = {name: schedule(tie) for name, tie in ties.items()}
    assert got["none"][0] == 4 and got["add"][0] <= 1, got  # the probe sees the ordering
    assert got["barrier"] == got["none"], (
        "XLA:CPU now orders work after an optimization barrier: zerojax.flax.unit_calls._depend "
        "could tie each gather to its anchor with jax.lax.optimization_barrier instead of an "
        "add of zero per leaf (no kernel, no arithmetic on the weights); try it there and "
        f"compare the stage-3 peaks and bench/compile_time.py ({got})."
    )
