"""A canary for a copy-free unit buffer (#40): one all-gather that moves all of a unit's leaves,
each into its own output, is XLA's variadic all-gather (what its combiners make on GPU). jax
issues one collective per array; a primitive emitting the variadic one is refused by jax's
partitioner (Shardy) inside `shard_map`, so `unit_buffers` packs the leaves into one array and
copies them out instead. When this test starts to fail (the xfail passes), the variadic gather
compiles: zerojax can then gather a unit with one collective and no copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

N = 8
gather_many = Primitive("zerojax_test_gather_many")
gather_many.multiple_results = True
gather_many.def_abstract_eval(
    lambda *avals: [a.update(shape=(N * a.shape[0], *a.shape[1:])) for a in avals]
)


def _lowering(ctx, *xs):
    return stablehlo.AllGatherOp(
        [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out],
        list(xs),
        all_gather_dim=ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0),
        replica_groups=ir.DenseIntElementsAttr.get(np.arange(N, dtype=np.int64)[None]),
        channel_handle=stablehlo.ChannelHandle.get(handle=1, type=1),
        use_global_device_ids=ir.UnitAttr.get(),
    ).results


mlir.register_lowering(gather_many, _lowering)


@pytest.mark.xfail(raises=jax.errors.JaxRuntimeError, strict=True, reason="Shardy, see above")
def test_one_variadic_all_gather_gathers_two_leaves():
    mesh = jax.make_mesh((N,), ("d",), devices=jax.devices()[:N])
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))  # noqa: E731
    a, b = put(jnp.arange(64.0).reshape(16, 4)), put(jnp.arange(24.0).reshape(8, 3))
    step = jax.jit(
        jax.shard_map(
            lambda *xs: tuple(gather_many.bind(*xs)),
            mesh=mesh,
            in_specs=(P("d"), P("d")),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    compiled = step.lower(a, b).compile()
    assert compiled.as_text().count("all-gather(") == 1
    got_a, got_b = compiled(a, b)
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)
