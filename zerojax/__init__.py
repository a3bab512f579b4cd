"""zerojax: DeepSpeed's ZeRO stages as sharding rules over a JAX device mesh."""

from zerojax.core import xla_flags as _xla_flags

_xla_flags.apply_defaults()  # before anything starts JAX's backend

from zerojax.core.config import ZeroConfig  # noqa: E402
from zerojax.core.errors import ZeroError, ZeroWarning  # noqa: E402
from zerojax.core.mesh import gpu_devices, make_mesh, tpu_devices  # noqa: E402
from zerojax.core.processes import initialize  # noqa: E402
from zerojax.deepspeed.optimizer import optimizer_from_config  # noqa: E402
from zerojax.engine.step import ZeroStep  # noqa: E402
from zerojax.moved import install as _install_moved_paths  # noqa: E402
from zerojax.shard import ZeroShard, zero_shard  # noqa: E402

_install_moved_paths()  # `zerojax.launch`, `zerojax.hlo`...: the paths a release documented

__all__ = [
    "CheckpointManager",
    "ZeroError",
    "ZeroConfig",
    "ZeroShard",
    "ZeroStep",
    "ZeroWarning",
    "gpu_devices",
    "initialize",
    "make_mesh",
    "tpu_devices",
    "optimizer_from_config",
    "zero_shard",
]


def __getattr__(name):
    if name == "CheckpointManager":  # orbax loads only when checkpoints are used
        from zerojax.io.checkpoint import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")


__version__ = "0.1.0"
