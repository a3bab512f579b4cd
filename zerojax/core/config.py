"""ZeroConfig: every zerojax option, its default and its meaning, in one frozen dataclass.

ZeroConfig computes nothing with jax: configs are built, validated and explained before any
device exists. (Importing it imports jax and optax all the same: the DeepSpeed reader it uses
knows the optimizer blocks `ds_optimizer` builds as optax.)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from zerojax.core.config_files import read_config
from zerojax.core.deepspeed_json import options_from_deepspeed
from zerojax.core.deepspeed_keys import batch_sizes, choice, offload_device
from zerojax.core.errors import ZeroError, nearest

__all__ = ["ZeroConfig", "resolve_config"]

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # option -> dtype


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """All zerojax options. Defaults follow DeepSpeed's where DeepSpeed has the same option."""

    stage: int = 0
    """ZeRO stage. 0: data parallel. 1: optimizer state sharded. 2: gradients too.
    3: parameters too, gathered on use. (DeepSpeed's default is 0 as well.)"""

    axis: str | tuple[str, ...] = "data"
    """Mesh axis over which state is sharded and the batch is split (a tuple of names shards
    over several axes at once). On a ('node', 'local') mesh from `zj.make_mesh(local=...)`
    zerojax uses both axes (MiCS: 'local' only) whatever this says."""

    persistence_threshold: int = 1024
    """Leaves with fewer elements than this stay replicated (DeepSpeed's
    `stage3_param_persistence_threshold`): sharding a 4 KiB leaf saves almost nothing and costs
    one collective per step. 0 shards every leaf that has a divisible dimension. A scanned
    stack's leaf is judged per layer when its unit runs: one whose layer is below this (a
    norm's scale) stays split at rest but is gathered once per step, whole, and its gradient
    reduced once, instead of one small collective per layer each way."""

    rules: tuple = ()
    """User rules, checked before the default: `(regex, dim)` pairs matched with `re.search`
    against a parameter's path such as `'Dense_0/kernel'`. `dim` is the dimension to split
    (negative counts from the end) or None to keep the leaf replicated. Optimizer-state leaves
    of the same path and shape follow their parameter's rule. A rule that matches no leaf
    warns, naming it."""

    logical_rules: tuple = ()
    """Tensor parallelism a model already declares: `(logical name, mesh axis or None)` pairs
    (Flax's convention) mapping the names of `nn.with_logical_partitioning` / NNX `sharding`
    metadata to mesh axes other than the ZeRO axis (e.g. `('mlp', 'model')` on a
    ('data', 'model') mesh). Names that are mesh axes already need no rule. ZeRO then adds its
    axis on another dimension of each leaf (see rules.py)."""

    prefetch: int = 1
    """Stage 3 units (see `units`): how many units ahead a unit's all-gather may be issued
    (0 or 1). 1 lets the next unit's gather run while this one computes, at the cost of one
    more unit of gathered weights alive (DeepSpeed prefetches by bucket size; here by unit).
    0 gathers each unit only once its input exists. Unrolled stacks get this from a data
    dependency on the previous unit's input; in a scanned body (one traced loop body) every
    gather depends only on its stored shard, left to XLA's scheduler and, across iterations,
    to its collective pipeliner on GPU (set by zerojax.core.xla_flags)."""

    units: str | tuple[str, ...] = "auto"
    r"""Stage 3: the modules whose parameters are gathered only while they run, chosen from
    outside the model (Linen and NNX; see zerojax.flax.units). A regex or a tuple of them,
    matched whole against module class names or paths ('Block', r'layers_\d+/mlp', NNX
    'blocks/0'); 'auto': the repeated blocks (each scanned body, each of two or more
    same-class siblings), as FSDP2 wraps each
    transformer block; () only the classes marked with `zj.flax.gather_on_use`. Parameters of
    no unit are gathered once at the start of the step and kept for backward. Stages 1-2
    gather nothing but reduce-scatter each unit's gradient as backward leaves it (so a
    scanned stack's gradient is never whole; NNX `nnx.scan` stacks excepted, reduced at the
    end of backward); stage 0 ignores it (like prefetch)."""

    recompute_units: bool = False
    """Stages 1-3 units: False keeps each unit's activations from forward to backward (the
    outputs of its matmuls and other non-elementwise operations; backward redoes elementwise
    work, re-layouts and casts from them) and only re-gathers its weights, so the step computes
    the plain step's matmuls (DeepSpeed and FSDP without activation checkpointing). True,
    backward recomputes a unit's forward from its saved input: activation checkpointing per
    unit, the least memory (a unit's activations exist only while it runs) for one more
    forward's FLOPs; `nn.remat` or `nnx.remat` in the model does the same. Either way the
    gathered weights are never kept between forward and backward."""

    keep_gathered: str | tuple[str, ...] = ()
    """Stage 3: regexes (matched whole) of unit paths whose gathered weights stay alive from
    forward to backward, which then gathers nothing for them: one all-gather less per unit and
    step, for those weights whole in memory in between (DeepSpeed's "selective unsharding").
    Usually chosen by `memory_budget`."""

    memory_budget: int | float | str = 0
    """Stage 3: the most a device may hold at the compiled peak ('70GB', '800MiB', bytes, or a
    fraction of the device's memory such as 0.9; 0: no budget). At the first call zerojax
    compiles the step as is (the smallest peak: a ZeroError names it if the budget is below)
    and then keeps gathered, by `keep_gathered`, as many units as fit, those whose gathers
    move the most bytes first; `step.budget` says what it chose. Stages 0-2: only checked."""

    unit_buffers: bool = False
    """Stage 3 units: gather each unit's split weights as one buffer per dtype (one all-gather
    each way) and reduce-scatter its gradients as one, instead of one collective per leaf; the
    split parameters no unit holds likewise, once per step. A leaf of 25 MiB or more (DDP's
    bucket cap, `comm.flat.ALONE_BYTES`) moves as itself: large enough alone, and packing would
    copy it. Fewer, larger collectives (3 per unit), at the cost of copying the leaves out of
    the gathered buffer and the gradients into theirs, as FSDP2 does (`bench/hlo_audit.py`
    and `bench/unit_collectives.py` measure both: on XLA:CPU the peak grows by about a
    layer's weights, gaps in its packing of temporaries; on TPU libtpu overlaps fewer of the
    packed gathers with matmuls, BENCHMARKS.md 1d). Stages 1-2:
    the gradient reduce-scatter only; stage 0: no effect. Refused on a mesh with
    tensor-parallel axes: packing would gather the model's own splits whole over them."""

    explicit_collectives: bool = True
    """Gather parameters and reduce gradients with explicit collectives around the model (a
    Linen `state.apply_fn` or closure's `model.apply` on the batch, an NNX model the step
    receives): a real reduce-scatter for stages 1-3 on every backend. False leaves every
    collective to XLA's partitioner, which on CPU turns stage 2's reduce-scatter into an
    all-reduce. Models with dropout, batch statistics or tensor-parallel axes run there too
    (`zerojax.comm.device_values`); a step that calls no model zerojax can run per device uses
    XLA's collectives (with a warning)."""

    donate: bool = True
    """Donate the state buffers to the step so the new state reuses their memory."""

    # ---- precision (DeepSpeed's `bf16` / `fp16` blocks) ---------------------------------------
    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16'. 16-bit: parameters are stored and used for compute in 16 bits,
    fp32 master weights live with the optimizer state (sharded from stage 1), and after each
    update the 16-bit copy is exactly `master.astype(dtype)`."""

    optimizer_state_dtype: str = "fp32"
    """dtype the optimizer's state (e.g. Adam's two moments) is stored in between steps: 'fp32'
    (float64 state stays float64) or 'bf16'. 'bf16' halves those bytes (4 bytes per parameter
    less for Adam); the update itself still runs in fp32 on the fp32 master weights, the state is
    rounded as it is stored. Non-scalar floating leaves only (a learning rate in
    `inject_hyperparams` stays exact)."""

    grad_reduce_dtype: str = "fp32"
    """dtype of the gradient all-reduce / reduce-scatter (DeepSpeed `communication_data_type`).
    fp32 by default (exact sums; a float64 model's gradients stay float64); 'bf16'/'fp16' halve
    the bytes and round each sum."""

    grad_accum_dtype: str = "fp32"
    """dtype of the gradient accumulation buffers (DeepSpeed `data_types.grad_accum_dtype`).
    fp32 by default (float64 for a float64 model): DeepSpeed's bf16 default there is a known
    source of divergence."""

    loss_scale: float = 0.0
    """fp16 only. 0: dynamic loss scaling; any other value: that static scale."""

    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""

    loss_scale_window: int = 1000
    """fp16: the scale doubles after this many consecutive steps without overflow."""

    hysteresis: int = 2
    """fp16: overflows tolerated (each still skips its step) before the scale is halved."""

    min_loss_scale: float = 1.0
    """fp16: the scale never goes below this; overflowing there raises an error."""

    # ---- ZeRO++ and MiCS (stage 3; DeepSpeed's zero_quantized_*, zero_hpz_*, mics_*) --------
    quantized_weights: bool = False
    """qwZ: stage-3 weight all-gathers move symmetric int8 blocks with one fp32 scale per block
    instead of 16-bit (or 32-bit) weights: half the bytes of bf16. The layer computes with the
    dequantized weight; gradients are those of the dequantized weight (straight through)."""

    quantized_weights_block: int = 256
    """qwZ elements per int8 block (one fp32 scale each: 1.6% extra bytes at 256)."""

    hpz_partition_size: int = 1
    """hpZ: > 1 keeps, after each stage-3 unit's forward gather, a secondary copy of
    its weights sharded over this many devices (one node: the mesh's 'local' axis), so that
    backward re-gathers inside the node, never across nodes. Costs 2 bytes (bf16) x layer
    parameters / this size per device between forward and backward. 1: off."""

    quantized_gradients: bool = False
    """qgZ: stage-3 gradient reduce-scatters become blockwise-quantized all-to-alls, inside
    the node first (dequantize, sum in fp32), then across nodes: 1/local of the gradient
    crosses nodes, in `quantized_gradients_bits` bits."""

    quantized_gradients_bits: int = 4
    """qgZ code width: 4 (two codes per byte) or 8."""

    quantized_gradients_block: int = 32
    """qgZ elements per block (one fp32 scale each). Smaller blocks: less error, more bytes."""

    mics_shard_size: int = -1
    """MiCS: > 0 shards the model states inside groups of this many devices (the mesh's 'local'
    axis) and replicates them across groups; gradients are reduce-scattered inside the group
    and all-reduced across groups. -1: off (DeepSpeed's default)."""

    # ---- the update ----------------------------------------------------------------------------
    gradient_accumulation_steps: int | str = 1
    """k: the step is called once per micro-batch and every k-th call applies the update with
    the mean of the k gradients (one optimizer step on a k-times larger batch). 'auto': inferred
    from train_batch_size and micro_batch_size once the device count is known."""

    train_batch_size: int | str = 0
    """DeepSpeed's train_batch_size: examples per optimizer step over all devices
    (= micro_batch_size x gradient_accumulation_steps x devices). 0: not set; 'auto': inferred."""

    micro_batch_size: int | str = 0
    """DeepSpeed's train_micro_batch_size_per_gpu: examples per device per call of the step;
    when set, a batch of another size is an error. 0: not set; 'auto': inferred."""

    accumulate: str = "auto"
    """Where gradients accumulate between micro-batches. 'local': each device sums its own
    unreduced gradients and they are reduced once per optimizer step (communication does not
    grow with k; full-size fp32 buffer per device; stages 0-2). 'reduced': reduce every
    micro-batch into the stage's gradient layout (sharded for stages 1-3: least memory,
    k times the gradient communication). 'auto': local for stages 0-2, reduced for stage 3."""

    gradient_clipping: float = 0.0
    """Clip the (accumulated, unscaled) gradient to this global L2 norm; 0 turns it off."""

    on_nonfinite: str = "off"
    """What a NaN or inf in the (accumulated) gradient does. 'skip': the update is not applied
    (parameters, optimizer state and step count stay) and the next call warns with the step
    number; 'stop': the same, then the next call raises ZeroError (a checkpoint saved after
    the bad step holds the unchanged, last good state). 'off': no check, like DeepSpeed
    without fp16; fp16 always skips overflowing steps (loss scaling)."""

    # ---- host offload (DeepSpeed's `offload_optimizer` / `offload_param`) ---------------------
    offload_optimizer: str | Mapping[str, Any] = "none"
    """'cpu' (or DeepSpeed's {"device": "cpu", "pin_memory": true}): optimizer state and fp32
    master weights rest in pinned host memory between steps and stream to the device for the
    update inside the compiled step. Stages 1-3. 'none' keeps them on the device."""

    offload_param: str | Mapping[str, Any] = "none"
    """Stage 3: 'cpu' keeps the parameter shards in pinned host memory between steps; they are
    brought to the device inside the step and written back with the update."""

    offload_activations: bool = False
    """Save the model's matmul outputs for backward in pinned host memory instead of device
    memory (a JAX remat policy around the model, `offload_dot_with_no_batch_dims`); everything
    else is recomputed in backward. Needs the `state.apply_fn` hook (explicit_collectives)."""

    offload_update: str = "device"
    """Where the optimizer update of offloaded state runs: 'device' (state streams to the device
    and back) or 'host' (`jax.experimental.compute_on('device_host')`: the update runs on the
    host CPU, only gradients and new parameters cross). 'host' needs offload_optimizer='cpu'."""

    def __post_init__(self):
        if not isinstance(self.stage, int) or self.stage not in (0, 1, 2, 3):
            raise ZeroError(
                f"stage must be 0, 1, 2 or 3 (got {self.stage!r}); "
                "stage 3 shards parameters, gradients and optimizer state."
            )
        if isinstance(self.axis, list):
            object.__setattr__(self, "axis", tuple(self.axis))
        names = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        if not names or not all(isinstance(a, str) and a for a in names):
            raise ZeroError(f"axis must be a mesh axis name such as 'data' (got {self.axis!r}).")
        if self.prefetch not in (0, 1):
            raise ZeroError(
                f"prefetch must be 0 or 1 layers ahead (got {self.prefetch!r}): "
                "more layers ahead only keeps more gathered weights alive."
            )
        if not isinstance(self.persistence_threshold, int) or self.persistence_threshold < 0:
            raise ZeroError(
                "persistence_threshold must be a number of elements >= 0 "
                f"(got {self.persistence_threshold!r})."
            )
        rules = tuple(tuple(r) for r in self.rules)
        for rule in rules:
            if (
                len(rule) != 2
                or not isinstance(rule[0], str)
                or not (rule[1] is None or isinstance(rule[1], int))
            ):
                raise ZeroError(f"each rule is (regex, dim or None); got {rule!r}.")
            try:
                re.compile(rule[0])
            except re.error as e:
                raise ZeroError(f"rule regex {rule[0]!r} does not compile: {e}.") from None
        object.__setattr__(self, "rules", rules)
        logical = tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in self.logical_rules)
        for rule in logical:
            if not (
                isinstance(rule, tuple)
                and len(rule) == 2
                and isinstance(rule[0], str)
                and (rule[1] is None or isinstance(rule[1], (str, tuple)))
            ):
                raise ZeroError(
                    "each logical rule is (logical name, mesh axis or None), e.g. "
                    f"('mlp', 'model'); got {rule!r}."
                )
        object.__setattr__(self, "logical_rules", logical)
        self._check_units()
        self._check_budget()
        for name in _BOOLEANS:
            if not isinstance(getattr(self, name), bool):
                raise ZeroError(f"{name} must be True or False (got {getattr(self, name)!r}).")
        self._check_update_options()
        self._check_offload_options()
        self._check_zeropp_options()

    def _check_budget(self):
        keep = (self.keep_gathered,) if isinstance(self.keep_gathered, str) else self.keep_gathered
        if not isinstance(keep, (tuple, list)) or not all(isinstance(p, str) for p in keep):
            raise ZeroError(
                f"keep_gathered must be a regex or a tuple of regexes of unit paths (got "
                f"{self.keep_gathered!r}), e.g. keep_gathered=(r'block_[0-3]',)."
            )
        for pattern in keep:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ZeroError(f"keep_gathered regex {pattern!r} does not compile: {e}.") from None
        object.__setattr__(self, "keep_gathered", tuple(keep))
        budget = self.memory_budget
        if isinstance(budget, str):
            budget = size_in_bytes(budget, "memory_budget")
        elif isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
            budget = -1
        if budget < 0 or (isinstance(budget, float) and budget > 1):
            raise ZeroError(
                f"memory_budget must be a size ('70GB', '800MiB', bytes) or a fraction of the "
                f"device's memory in (0, 1] (got {self.memory_budget!r}); 0 for none."
            )
        object.__setattr__(self, "memory_budget", budget)

    def _check_units(self):
        units = tuple(self.units) if isinstance(self.units, list) else self.units
        object.__setattr__(self, "units", units)
        patterns = () if units == "auto" else (units,) if isinstance(units, str) else units
        if not isinstance(patterns, tuple) or not all(isinstance(p, str) for p in patterns):
            raise ZeroError(
                f"units must be 'auto', a regex or a tuple of regexes (got {units!r}), e.g. "
                "units='Block' or units=(r'layers_\\d+/attn', r'layers_\\d+/mlp')."
            )
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ZeroError(f"units regex {pattern!r} does not compile: {e}.") from None

    def _check_zeropp_options(self):
        for name, low in (
            ("hpz_partition_size", 1),
            ("mics_shard_size", -1),
            ("quantized_weights_block", 2),
            ("quantized_gradients_block", 2),
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ZeroError(f"{name} must be an integer >= {low} (got {value!r}).")
        choice("quantized_gradients_bits", self.quantized_gradients_bits, (4, 8))
        if self.quantized_gradients_block % 2:
            raise ZeroError(
                "quantized_gradients_block must be even (int4 codes are packed two "
                f"per byte; got {self.quantized_gradients_block})."
            )
        used = [f"{option} ({name})" for name, option in self.zeropp_options]
        if used and not self.shards_parameters:
            raise ZeroError(
                f"{', '.join(used)} need stage 3 (got stage {self.stage}): they "
                "change stage 3's parameter gathers and gradient reduce-scatters."
            )
        if used and not self.explicit_collectives:
            raise ZeroError(
                f"{', '.join(used)} are zerojax's own collectives around "
                "state.apply_fn: they need explicit_collectives=True."
            )
        if self.hpz_partition_size > 1 and self.mics_shard_size > 0:
            raise ZeroError(
                "hpz_partition_size and mics_shard_size both group the devices of "
                "a node: MiCS already keeps every gather inside the node; use one."
            )

    def _check_offload_options(self):
        for name in ("offload_optimizer", "offload_param"):
            object.__setattr__(self, name, offload_device(name, getattr(self, name)))
        if self.offload_optimizer == "cpu" and not self.shards_optimizer_state:
            raise ZeroError(
                "offload_optimizer needs stage >= 1 (stage 0 keeps a whole optimizer "
                "state per device; shard it first, as DeepSpeed requires)."
            )
        if self.offload_param == "cpu" and not self.shards_parameters:
            raise ZeroError(
                f"offload_param needs stage 3 (got stage {self.stage}): only stage 3 "
                "shards the parameters that it would keep on the host."
            )
        choice("offload_update", self.offload_update, ("device", "host"))
        if self.offload_update == "host" and self.offload_optimizer != "cpu":
            raise ZeroError(
                "offload_update='host' runs the update where the offloaded optimizer "
                "state lives: set offload_optimizer='cpu' too."
            )
        if self.offload_activations and not self.explicit_collectives:
            raise ZeroError(
                "offload_activations applies its remat policy around state.apply_fn: "
                "it needs explicit_collectives=True."
            )

    def _check_update_options(self):
        choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        choice("optimizer_state_dtype", self.optimizer_state_dtype, ("fp32", "bf16"))
        choice("grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16", "fp16"))
        choice("grad_accum_dtype", self.grad_accum_dtype, ("fp32", "bf16", "fp16"))
        choice("accumulate", self.accumulate, ("auto", "local", "reduced"))
        choice("on_nonfinite", self.on_nonfinite, ("off", "skip", "stop"))
        if self.gradient_accumulation_steps != "auto" and (
            not _is_int(self.gradient_accumulation_steps) or self.gradient_accumulation_steps < 1
        ):
            raise ZeroError(
                "gradient_accumulation_steps must be an integer >= 1 or 'auto' (got "
                f"{self.gradient_accumulation_steps!r})."
            )
        for name in ("train_batch_size", "micro_batch_size"):
            value = getattr(self, name)
            if value != "auto" and (not _is_int(value) or value < 0):
                raise ZeroError(
                    f"{name} must be an integer >= 0 (0: not set) or 'auto' (got {value!r})."
                )
        if self.accumulate == "local" and self.shards_parameters:
            raise ZeroError(
                "accumulate='local' keeps a full-size gradient buffer per device, "
                "which stage 3 exists to avoid: use accumulate='reduced' (or 'auto')."
            )
        if not self.gradient_clipping >= 0:
            raise ZeroError(f"gradient_clipping must be >= 0 (got {self.gradient_clipping!r}).")
        if self.precision != "fp16":
            changed = [f for f in _SCALING if getattr(self, f) != self.defaults()[f]]
            if changed:
                raise ZeroError(
                    f"{', '.join(changed)} only apply with precision='fp16' (got "
                    f"precision={self.precision!r}); bf16 and fp32 need no loss scale."
                )
        elif not (
            self.loss_scale >= 0
            and self.min_loss_scale > 0
            and self.hysteresis >= 1
            and self.loss_scale_window >= 1
            and self.initial_scale_power >= 0
        ):
            raise ZeroError(
                "fp16 loss scaling needs loss_scale >= 0, min_loss_scale > 0, "
                "hysteresis >= 1, loss_scale_window >= 1, initial_scale_power >= 0."
            )

    def for_devices(self, n: int) -> ZeroConfig:
        """This config with DeepSpeed's batch arithmetic done for `n` data-parallel devices
        (`deepspeed.batch_sizes`: any two of the three batch options infer the third)."""
        tb, mb, k = batch_sizes(
            self.train_batch_size, self.micro_batch_size, self.gradient_accumulation_steps, n
        )
        return dataclasses.replace(
            self, gradient_accumulation_steps=k, train_batch_size=tb, micro_batch_size=mb
        )

    # what each stage splits over the ZeRO axis: the one place stage numbers mean something
    @property
    def shards_optimizer_state(self) -> bool:
        """Stage >= 1: each device keeps only its slice of the optimizer state."""
        return self.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Stage >= 2: gradients are reduce-scattered to the slice each device updates."""
        return self.stage >= 2

    @property
    def uses_units(self) -> bool:
        """Stages 1-3: the model's units run through zerojax (gathered at stage 3, their
        gradients reduce-scattered as backward leaves them at stages 1-2); stage 0 has none."""
        return self.stage >= 1

    @property
    def shards_parameters(self) -> bool:
        """Stage 3: parameters rest split too, gathered where the model uses them."""
        return self.stage == 3

    def packs_unit_buffers(self, tensor_axes: tuple[str, ...]) -> bool:
        """`unit_buffers`, checked against the mesh: packing reshapes and concatenates leaves
        the model splits over its tensor-parallel axes, so XLA would gather them whole there
        (undoing the model's tensor parallelism, silently): refused."""
        if self.unit_buffers and tensor_axes:
            raise ZeroError(
                f"unit_buffers=True on a mesh with tensor-parallel axes {list(tensor_axes)}: "
                "packing a unit's leaves into one buffer would gather the model's own splits "
                "whole over those axes. Leave unit_buffers=False there (one collective per "
                "leaf)."
            )
        return self.unit_buffers

    @property
    def zeropp_options(self) -> list[tuple[str, str]]:
        """(technique, option) of each ZeRO++ technique and MiCS this config turns on."""
        return [
            (name, option)
            for name, option, on in (
                ("qwZ", "quantized_weights", self.quantized_weights),
                ("hpZ", "hpz_partition_size", self.hpz_partition_size > 1),
                ("qgZ", "quantized_gradients", self.quantized_gradients),
                ("MiCS", "mics_shard_size", self.mics_shard_size > 0),
            )
            if on
        ]

    @property
    def accumulation_steps(self) -> int:
        """k, the micro-batches per optimizer step, once known ('auto' is inferred from the
        batch sizes for a device count: `for_devices`, as `zero_shard` does)."""
        k = self.gradient_accumulation_steps
        if isinstance(k, str):
            raise ZeroError(
                f"gradient_accumulation_steps={k!r} is known once the device count is: read "
                "zero_shard(...).config, or ZeroConfig.for_devices(n), not the config given."
            )
        return k

    @property
    def accumulates_locally(self) -> bool:
        """Whether micro-batch gradients stay per device until the optimizer step."""
        return self.accumulation_steps > 1 and (
            self.accumulate == "local" or (self.accumulate == "auto" and not self.shards_parameters)
        )

    @property
    def offloads_optimizer(self) -> bool:
        """The optimizer state and master weights rest in pinned host memory."""
        return self.offload_optimizer == "cpu"

    @property
    def offloads_params(self) -> bool:
        """Stage 3: the parameter shards rest in pinned host memory between steps."""
        return self.offload_param == "cpu"

    @property
    def uses_host_memory(self) -> bool:
        """Some state or activation rests in, or some work runs on, the host's memory."""
        return (
            self.offloads_optimizer
            or self.offloads_params
            or self.offload_activations
            or self.updates_on_host
        )

    @property
    def updates_on_host(self) -> bool:
        """The optimizer step itself runs on the host CPU, beside its offloaded state."""
        return self.offload_update == "host"

    @property
    def uses_16bit(self) -> bool:
        """bf16 or fp16: parameters stored and computed in 16 bits over fp32 master weights."""
        return self.precision != "fp32"

    @property
    def scales_loss(self) -> bool:
        """fp16: the loss is scaled (a static `loss_scale`, or dynamically)."""
        return self.precision == "fp16"

    @property
    def scales_loss_dynamically(self) -> bool:
        """fp16 without a static `loss_scale`: DeepSpeed's dynamic loss scaler."""
        return self.scales_loss and not self.loss_scale

    @property
    def manages_update(self) -> bool:
        """Whether zerojax takes over the update (master weights, scaling, accumulation, clip)."""
        return (
            self.uses_16bit
            or self.optimizer_state_dtype != "fp32"
            or self.accumulation_steps > 1
            or self.gradient_clipping > 0
            or self.updates_on_host
            or self.on_nonfinite != "off"
        )

    def inert_options(self) -> dict[str, str]:
        """{option: when and why it does nothing here} for each option set away from its
        default that this config's stage or other options leave without effect
        (`INERT_OPTIONS`, the first that holds); `zero_shard` warns about them once."""
        defaults, idle = self.defaults(), {}
        for name, holds, when, why in INERT_OPTIONS:
            if name not in idle and getattr(self, name) != defaults[name] and holds(self):
                idle[name] = f"{when}: {why}"
        return idle

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """{option: default} for every option."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    def replace(self, **overrides) -> ZeroConfig:
        """A copy with `overrides`; an unknown name raises ZeroError naming the nearest one."""
        names = list(self.defaults())
        for key in overrides:
            if key not in names:
                raise ZeroError(
                    f"unknown zerojax option {key!r}{nearest(key, names)}; "
                    f"options are: {', '.join(names)}."
                )
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_json(
        cls,
        source: str | os.PathLike | Mapping[str, Any],
        strict: bool = True,
        auto: Mapping[str, Any] | None = None,
    ) -> ZeroConfig:
        """Read a DeepSpeed-style JSON config (a path, a preset name or a loaded dict). An
        "auto" value takes the option `auto` gives (the keyword options passed beside the
        config, as the HF Trainer fills it from its arguments), else zerojax's default."""
        defaults = {**cls.defaults(), **(auto or {})}
        return cls(**options_from_deepspeed(read_config(source), strict, defaults))


SIZE_UNITS = {"": 1, "B": 1} | {
    p + suffix: base**i
    for i, p in enumerate("KMGT", 1)
    for suffix, base in (("B", 1000), ("IB", 1024))
}


def size_in_bytes(text: str, name: str = "size") -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30 (GB is decimal, GiB binary)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise ZeroError(f"{name}: {text!r} is not a size such as 80GB or 80GiB.")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_BOOLEANS = (
    "explicit_collectives",
    "unit_buffers",
    "donate",
    "quantized_weights",
    "quantized_gradients",
    "offload_activations",
)
_SCALING = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)


# The options most runs set, the surface of FSDP2's `fully_shard` and DeepSpeed's
# `zero_optimization` block; the others (docs/options.md's "Advanced") tune how those act.
USER_OPTIONS = (
    "stage",
    "units",
    "recompute_units",
    "precision",
    "gradient_accumulation_steps",
    "train_batch_size",
    "micro_batch_size",
    "gradient_clipping",
    "on_nonfinite",
    "offload_optimizer",
    "offload_param",
    "memory_budget",
    "quantized_weights",
    "hpz_partition_size",
    "quantized_gradients",
    "mics_shard_size",
)

# When an option, set away from its default, does nothing: (option, predicate, when, why).
# tests/test_option_sweep.py lowers every option at every stage: a warned option must leave
# the step unchanged, any other must change it (or be refused with a ZeroError).
_NO_UNITS = "stage 0 all-reduces the gradients after the whole backward, it has no units"
_NOT_GATHERED = "only stage 3 gathers parameters"
_XLA = "XLA then places every gather and reduction, there are no units"
_ONE_STEP = "nothing accumulates"
INERT_OPTIONS: tuple = (
    *(
        (name, lambda c: not c.shards_optimizer_state, "at stage 0", "it splits no leaf")
        for name in ("persistence_threshold", "rules")
    ),
    ("units", lambda c: not c.uses_units, "at stage 0", _NO_UNITS),
    ("recompute_units", lambda c: not c.uses_units, "at stage 0", _NO_UNITS),
    ("unit_buffers", lambda c: not c.uses_units, "at stage 0", _NO_UNITS),
    ("prefetch", lambda c: not c.shards_parameters, "at stages 0-2", _NOT_GATHERED),
    ("keep_gathered", lambda c: not c.shards_parameters, "at stages 0-2", _NOT_GATHERED),
    *(
        (name, lambda c: not c.explicit_collectives, "with explicit_collectives=False", _XLA)
        for name in ("units", "recompute_units", "unit_buffers", "prefetch", "keep_gathered")
    ),
    *(
        (
            name,
            lambda c: c.gradient_accumulation_steps == 1,
            "with one micro-batch per step (gradient_accumulation_steps=1)",
            _ONE_STEP,
        )
        for name in ("accumulate", "grad_accum_dtype")
    ),
    *(
        (name, lambda c: not c.quantized_weights, "without quantized_weights", "qwZ is off")
        for name in ("quantized_weights_block",)
    ),
    *(
        (name, lambda c: not c.quantized_gradients, "without quantized_gradients", "qgZ is off")
        for name in ("quantized_gradients_bits", "quantized_gradients_block")
    ),
)


def resolve_config(config=None, strict: bool = True, **overrides) -> ZeroConfig:
    """ZeroConfig from a ZeroConfig, a JSON path or dict, or None; keyword options override it.
    `strict=False`: unknown DeepSpeed keys warn instead of failing."""
    if config is None:
        base = ZeroConfig()
    elif isinstance(config, ZeroConfig):
        base = config
    elif isinstance(config, (str, os.PathLike, Mapping)):
        base = ZeroConfig.from_json(config, strict=strict, auto=overrides)
    else:
        raise ZeroError(
            "config must be a ZeroConfig, a path to a DeepSpeed JSON file or a "
            f"dict; got {type(config).__name__}."
        )
    return base.replace(**overrides) if overrides else base
