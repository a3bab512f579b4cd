"""Which mesh axes each collective runs over, and the ZeRO++ / MiCS variants of them.

`Comm` is the one description the model hook, the per-layer gather and the step share: the axes
the state is split over (`shard`, outermost first), the axes it is replicated over (`replica`:
MiCS groups), the batch axes (`data`: all of them, in mesh order), and the ZeRO++ options:
- qwZ (`weight_bits=8`): weight all-gathers move int8 blocks plus fp32 scales;
- qgZ (`grad_bits=4|8`): gradient reduce-scatters are quantized all-to-alls, one mesh level
  at a time (`comm.quant.quantized_reduce_scatter`);
- hpZ (`secondary='local'`): a layer keeps, after its forward gather, the slice of the full
  weight that is this device's shard over the node's devices only, and backward re-gathers it
  inside the node.
With `buffers` (`unit_buffers=True`) a call's split leaves move as one buffer per dtype
(`comm.flat`).
The functions below run inside `shard_map` on one device's values.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.comm.quant import quantized_all_gather, quantized_reduce_scatter
from zerojax.core.config import ZeroConfig
from zerojax.core.errors import ZeroError
from zerojax.core.policy import working_dtype

NODE, LOCAL = "node", "local"


def axis_name(axes):
    """A PartitionSpec / collective axis name for `(name, size)` pairs: one name or a tuple."""
    names = tuple(name for name, _ in axes)
    return names[0] if len(names) == 1 else names


@dataclasses.dataclass(frozen=True)
class Comm:
    """Axes and options of zerojax's explicit collectives (see the module docstring)."""

    shard: tuple  # ((axis, size), ...) the state is split over, outermost first
    data: tuple  # ((axis, size), ...) the batch is split over, mesh order
    replica: tuple = ()  # ((axis, size), ...) MiCS: state replicated over these
    weight_bits: int = 0  # 8: qwZ
    weight_block: int = 256
    grad_bits: int = 0  # 4 or 8: qgZ
    grad_block: int = 32
    secondary: str | None = None  # hpZ: the axis of the secondary copy
    tensor: tuple = ()  # ((axis, size), ...) other mesh axes: the model's own (TP)
    buffers: bool = False  # unit_buffers: split leaves move as one buffer per dtype (comm.flat)

    @property
    def shard_axis(self):
        return axis_name(self.shard)

    @property
    def data_axis(self):
        return axis_name(self.data)

    @property
    def shard_size(self) -> int:
        return math.prod(size for _, size in self.shard)

    @property
    def data_size(self) -> int:
        return math.prod(size for _, size in self.data)


def comm_for(mesh, cfg: ZeroConfig) -> Comm:
    """The `Comm` of `cfg` on `mesh`: its `axis` on a 1-D (or any) mesh that has it; on a
    ('node', 'local') mesh, both axes (MiCS: 'local' only, replicated over 'node')."""
    sizes = dict(mesh.shape)
    hierarchical = NODE in sizes and LOCAL in sizes
    if hierarchical:
        data = tuple((a, sizes[a]) for a in mesh.axis_names if a in (NODE, LOCAL))
        shard = ((LOCAL, sizes[LOCAL]),) if cfg.mics_shard_size > 0 else data
    else:
        names = cfg.axis if isinstance(cfg.axis, tuple) else (cfg.axis,)
        missing = [a for a in names if a not in sizes]
        if missing:
            raise ZeroError(
                f"the mesh has axes {tuple(mesh.axis_names)}, not the config's axis "
                f"{cfg.axis!r}; pass axis= to match the mesh, or use "
                "zj.make_mesh(local=...) for a ('node', 'local') mesh."
            )
        data = shard = tuple((a, sizes[a]) for a in names)
    if (cfg.hpz_partition_size > 1 or cfg.mics_shard_size > 0) and not hierarchical:
        raise ZeroError(
            "hpZ (zero_hpz_partition_size) and MiCS (mics_shard_size) need a "
            "('node', 'local') mesh: pass mesh=zj.make_mesh(local=...) or leave "
            "mesh unset so zerojax builds one."
        )
    for option, size in (
        ("zero_hpz_partition_size", cfg.hpz_partition_size),
        ("mics_shard_size", cfg.mics_shard_size),
    ):
        if size > 1 and sizes[LOCAL] != size:
            raise ZeroError(
                f"{option}={size} must equal the mesh's 'local' axis size "
                f"({sizes[LOCAL]}): the group is the devices of one node."
            )
    replica = tuple(pair for pair in data if pair not in shard)
    tensor = tuple((a, sizes[a]) for a in mesh.axis_names if (a, sizes[a]) not in data)
    return Comm(
        shard=shard,
        data=data,
        replica=replica,
        tensor=tensor,
        weight_bits=8 if cfg.quantized_weights else 0,
        weight_block=cfg.quantized_weights_block,
        grad_bits=cfg.quantized_gradients_bits if cfg.quantized_gradients else 0,
        grad_block=cfg.quantized_gradients_block,
        secondary=LOCAL if cfg.hpz_partition_size > 1 else None,
        buffers=cfg.packs_unit_buffers(tuple(a for a, _ in tensor)),
    )


def manual_over_data(f, mesh, comm: Comm, in_specs, out_specs, check_vma: bool = True):
    """`jax.shard_map(f)` manual over the data axes only: the mesh's other axes (the model's own
    tensor parallelism) stay XLA's, inside `f` too, so the specs keep only the data axes (the
    model's are dropped from them; each array keeps its sharding over them).
    `check_vma=False` where `f` runs user code (the model): JAX then types nothing as varying
    over the devices, so code `jax.jit` accepts (a scan carry built from zeros, exact GELU's
    JVP) runs unchanged; autodiff follows the specs alone: an input whose spec names no data
    axis gets its per-device cotangents summed over them as backward leaves `f`, and a
    replicated output's cotangent enters `f` divided by the device count."""
    manual = frozenset(a for a, _ in comm.data)

    def keep(entry):
        names = tuple(
            a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in manual
        )
        return None if not names else names[0] if len(names) == 1 else names

    specs = lambda tree: jax.tree_util.tree_map(
        lambda spec: P(*(keep(e) for e in spec)), tree, is_leaf=lambda x: isinstance(x, P)
    )
    options = {"axis_names": manual} if comm.tensor else {}
    return jax.shard_map(
        f,
        mesh=mesh,
        in_specs=specs(in_specs),
        out_specs=specs(out_specs),
        check_vma=check_vma,
        **options,
    )


def gather_weight(x, dim, comm: Comm, dtype):
    """This device's shard `x` (already in the compute dtype `dtype`) gathered along `dim`
    over the shard axes: int8 blocks with qwZ, else as is. `dim` None: `x` is whole."""
    if dim is None:
        return x
    if comm.weight_bits and jnp.issubdtype(x.dtype, jnp.floating):
        return quantized_all_gather(x, comm.shard_axis, dim, comm.weight_block, dtype)
    gather = lambda rows: jax.lax.all_gather(rows, comm.shard_axis, axis=dim, tiled=True)
    return _on_rows(gather, x, dim, comm)


def _on_rows(collective, x, dim: int, comm: Comm):
    """`collective` (which resizes `dim`) applied to `x` with the dims after `dim` merged
    into one (a free reshape), its result back in `x`'s trailing dims, so that it moves rows:
    libtpu lays a `[d, heads, head_dim]` kernel's gradient out `d` minor and reduce-scatters
    it on `d` as an all-reduce and a slice (twice the bytes, and the whole gradient alive),
    but reduce-scatters its `[d, heads * head_dim]` view (bench/hlo_audit.py
    --topology v5e:2x4, 125m: 36 all-reduces of 3.9 MiB per step become reduce-scatters).
    Gathers move the same view (its peak 9,734.1 -> 9,727.6 MiB). Not with tensor-parallel
    axes: a merged dim may be split over one of them."""
    if x.ndim <= dim + 2 or comm.tensor:
        return collective(x)
    out = collective(x.reshape(*x.shape[: dim + 1], -1))
    return out.reshape(*out.shape[: dim + 1], *x.shape[dim + 1 :])


def in_reduce_dtype(g, reduce_dtype):
    """A floating gradient in the dtype it is reduced in (`working_dtype` of `reduce_dtype`,
    grad_reduce_dtype's); None, and integer gradients, keep theirs."""
    if reduce_dtype is None or not jnp.issubdtype(g.dtype, jnp.floating):
        return g
    return g.astype(working_dtype(g.dtype, reduce_dtype))


def reduce_gradient(g, dim, comm: Comm, reduce_dtype, replicas: bool = True):
    """One device's gradient summed over all devices: split along `dim` over the shard axes
    (a reduce-scatter; quantized all-to-alls with qgZ) then summed over the replica axes, or,
    when `dim` is None, all-reduced whole. `replicas=False` leaves out the replica sum (for
    a unit's leaves, whose replica sum the model's `shard_map` does as backward leaves it: their
    spec names no replica axis). `reduce_dtype`
    (None keeps it) is the dtype of the unquantized collectives. The one place where zerojax
    reduces gradients."""
    g = in_reduce_dtype(g, reduce_dtype)
    replica = axis_name(comm.replica) if comm.replica and replicas else None
    if dim is None:
        return jax.lax.psum(g, comm.data_axis if replica else comm.shard_axis)
    if comm.grad_bits and jnp.issubdtype(g.dtype, jnp.floating):
        g = quantized_reduce_scatter(g, dim, comm.shard, comm.grad_bits, comm.grad_block).astype(
            g.dtype
        )
    else:
        scatter = lambda rows: jax.lax.psum_scatter(
            rows, comm.shard_axis, scatter_dimension=dim, tiled=True
        )
        g = _on_rows(scatter, g, dim, comm)
    return jax.lax.psum(g, replica) if replica else g


def secondary_shard(full, dim, comm: Comm):
    """hpZ: this device's slice of a gathered weight over the node's devices only (1/local of
    it), kept for backward instead of re-gathering across nodes."""
    size = full.shape[dim] // dict(comm.shard)[comm.secondary]
    start = jax.lax.axis_index(comm.secondary) * size
    return jax.lax.dynamic_slice_in_dim(full, start, size, axis=dim)


def gather_secondary(x, dim, comm: Comm):
    """hpZ: the full weight from the node's secondary shards (an all-gather inside the node)."""
    return jax.lax.all_gather(x, comm.secondary, axis=dim, tiled=True)
