"""What a zerojax step really costs, read from the compiled executable (never estimated).

Memory: `compiled.memory_analysis()` per device, plus the state's resident bytes on device 0
summed from its live shards by category. Communication: every collective of the HLO module
right after SPMD partitioning (dumped during compilation), where each collective still has the
dtype the program sends (the CPU compiler later upcasts 16-bit collectives to f32), counted by
`hlo.parse_collectives`; what the accelerator's schedule overlaps, by `schedule`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import os
import re
import tempfile

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from zerojax.core import xla_flags
from zerojax.core.rules import HOST, OPT_STATE, OTHER, PARAMS
from zerojax.engine.state import split_call
from zerojax.inspect import cross_compile
from zerojax.inspect.describe import leaf_rows
from zerojax.inspect.hlo import matmul_flops, parse_collectives
from zerojax.inspect.peak import Peak, explain_peak
from zerojax.inspect.schedule import (
    host_transfers,
    launches,
    overlap_bytes,
    scheduled_collectives,
)


@dataclasses.dataclass
class Report:
    """Per-device memory and per-step communication of one compiled zerojax step."""

    stage: int
    devices: int
    resident: dict  # category -> bytes of the live state in device 0's memory
    host_resident: dict  # category -> bytes of device 0's offloaded state (pinned host)
    host_argument_bytes: int  # step arguments in host memory (offloaded state)
    streamed_bytes: int  # offloaded state the step copies into device memory (see below)
    kept_replicated: int  # bytes of leaves this stage would shard but the policy keeps whole
    argument_bytes: int  # step arguments in device memory
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    collectives: list
    peak: Peak | None = None  # what is alive at the compiled peak (XLA's live ranges)
    # the collectives of the compiled (scheduled) program, each overlapped with a matmul or
    # exposed (`schedule`): after the compiler's combiners; on CPU every one is exposed
    scheduled: list = dataclasses.field(default_factory=list)
    xla_flags: dict = dataclasses.field(default_factory=dict)  # zerojax's defaults in force
    # floating-point operations of the step's matmuls per device per step, read from the
    # partitioned module (its dots, before a TPU compiler rewrites them as convolutions), loop
    # bodies once per iteration (`hlo.matmul_flops`; `cost_analysis()` counts a body once)
    matmul_flops: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """Compiled peak per device: device arguments alive for the whole step plus
        temporaries."""
        return self.argument_bytes + self.temp_bytes

    @property
    def peak_bound_bytes(self) -> int:
        """`peak_bytes` plus every offloaded byte the step brings to the device, as if all were
        there at once: an upper bound. (CPU compilers keep host and device in one memory and
        elide the copies, so their temporaries cannot show where XLA schedules them; a GPU or
        TPU program's temporaries do hold them, and there the bound is the peak.)"""
        return self.peak_bytes + self.streamed_bytes

    def comm_table(self):
        """{(kind, dtype): [count, buffer bytes, sent bytes, cross-node sent bytes]} summed
        over the step."""
        table = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
        for c in self.collectives:
            row = table[(c.kind, c.dtype)]
            row[0] += 1
            row[1] += c.buffer_bytes
            row[2] += c.sent_bytes
            row[3] += c.sent_bytes if c.cross_node else 0.0
        return dict(table)

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per step, all collectives."""
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def cross_node_bytes(self) -> float:
        """Bytes one device sends per step in collectives whose groups span two nodes (all of a
        collective's bytes count when its group does; 0 on a one-node mesh)."""
        return sum(c.sent_bytes for c in self.collectives if c.cross_node)

    @property
    def overlap(self) -> tuple[float, float]:
        """(bytes one device sends per step in collectives the compiled schedule overlaps with
        a matmul, in exposed ones)."""
        return overlap_bytes(self.scheduled)

    @property
    def launches(self) -> dict[str, int]:
        """Collective launches per step by kind, as the compiled program runs them (a combined
        or variadic collective is one launch, however many arrays it moves)."""
        return dict(collections.Counter(kind for kind, _ in launches(self.scheduled)))

    @property
    def host_copies(self) -> dict[str, tuple[int, int]]:
        """{'device-to-host' / 'host-to-device': (bytes copied beside a matmul, exposed)} per
        device per step, from the compiled program's asynchronous copies (GPU, TPU)."""
        return host_transfers(self.scheduled)

    def bytes_of(self, kind: str) -> int:
        return sum(c.buffer_bytes for c in self.collectives if c.kind == kind)

    def __str__(self):
        mb = lambda b: f"{b / 2**20:10.3f}"
        lines = [
            f"zerojax stage {self.stage} on {self.devices} devices (per device, MiB)",
            "state resident on device 0:",
        ]
        for cat in CATEGORIES:
            if cat in self.resident or cat in (PARAMS, "optimizer state"):
                lines.append(f"  {cat:<28}{mb(self.resident.get(cat, 0))}")
        lines.append(f"  {'total':<28}{mb(sum(self.resident.values()))}")
        lines.append(f"  {'of which kept replicated':<28}{mb(self.kept_replicated)}")
        if self.host_resident:
            lines.append("state offloaded to host memory (pinned_host) for device 0:")
            for cat in CATEGORIES:
                if cat in self.host_resident:
                    lines.append(f"  {cat:<28}{mb(self.host_resident[cat])}")
            lines.append(f"  {'total':<28}{mb(sum(self.host_resident.values()))}")
        lines += [
            "compiled step (memory_analysis):",
            f"  {'arguments (device)':<28}{mb(self.argument_bytes)}",
            f"  {'temporaries':<28}{mb(self.temp_bytes)}",
            f"  {'outputs (aliased)':<28}{mb(self.output_bytes)} ({mb(self.alias_bytes).strip()})",
            f"  {'peak (arguments + temp)':<28}{mb(self.peak_bytes)}",
        ]
        if self.streamed_bytes:
            lines.append(
                f"  {'+ offloaded state streamed':<28}{mb(self.streamed_bytes)} (peak "
                f"bound {mb(self.peak_bound_bytes).strip()})"
            )
        lines += [
            "communication per optimizer step (HLO after SPMD partitioning):",
            f"  {'collective':<20}{'dtype':<7}{'count':>6}{'buffer MiB':>12}{'sent MiB':>11}"
            f"{'cross-node':>11}",
        ]
        for (kind, dtype), (count, buf, sent, cross) in sorted(self.comm_table().items()):
            lines.append(
                f"  {kind:<20}{dtype:<7}{count:>6}{mb(buf):>12}{mb(sent):>11}{mb(cross):>11}"
            )
        if not self.collectives:
            lines.append("  (none)")
        hidden, exposed = self.overlap
        runs = ", ".join(f"{n} {kind}" for kind, n in sorted(self.launches.items())) or "none"
        lines.append(
            f"compiled schedule: {sum(self.launches.values())} collective launches ({runs}), "
            f"{mb(hidden).strip()} MiB sent while a matmul runs (overlapped), "
            f"{mb(exposed).strip()} MiB exposed"
        )
        for kind, (beside, alone) in self.host_copies.items():
            if beside + alone:
                lines.append(
                    f"  {kind} copies: {mb(beside + alone).strip()} MiB per step, "
                    f"{mb(beside).strip()} MiB of them beside a matmul"
                )
        lines.append(
            f"compiled matmuls: {self.matmul_flops / 1e9:.3f} GFLOP per device per step "
            "(loop bodies once per iteration)"
        )
        if self.peak is not None:
            lines.append(self.peak.format(top=5).rstrip())
        for name, value in self.xla_flags.items():
            lines.append(f"XLA flag {name}: {value}")
        return "\n".join(lines)


CATEGORIES = (PARAMS, "optimizer state", "master weights", "gradient buffers", OTHER)
_OPT_FIELDS = {
    "master": "master weights",
    "accum": "gradient buffers",
    "per_device": "gradient buffers",
}


def _category(plan) -> str:
    """Report category of a leaf: optimizer-state leaves of a managed state are split into the
    user's optimizer state, fp32 master weights and persistent gradient buffers."""
    if plan.category != OPT_STATE:
        return plan.category
    field = plan.path.split("/")[1] if plan.path.count("/") else ""
    return _OPT_FIELDS.get(field, "optimizer state")


def resident_bytes(zero, state):
    """(device bytes by category, host bytes by category, bytes kept replicated) of `state`'s
    shards on each device (`describe.leaf_rows`), split by each leaf's memory kind."""
    by_cat, on_host = collections.Counter(), collections.Counter()
    kept = 0
    for plan, row in zip(zero.plan(state), leaf_rows(zero, state), strict=True):
        (on_host if row.memory == HOST else by_cat)[_category(plan)] += row.bytes_per_device
        if plan.meant and plan.reason.startswith("replicated"):
            kept += row.bytes_per_device
    return dict(by_cat), dict(on_host), kept


@contextlib.contextmanager
def _no_compilation_cache():
    """JAX's persistent compilation cache off inside (jax decides once whether it uses the
    cache, so switching it also resets that decision), as it was after."""
    was_on = jax.config.values["jax_enable_compilation_cache"]
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was_on)
        compilation_cache.reset_cache()


# The SPMD partitioner's pass: 'spmd-partitioning' in the CPU and GPU compilers; the TPU
# compiler runs 'shardy-xla' (which partitions shard_map's manual code) and then, in newer
# libtpus, 'tpu-spmd-partitioning' (which partitions what XLA places itself): the last one
# dumped is the partitioned module.
_PARTITIONER = "spmd-partitioning|shardy-xla"


def compile_with_partitioned_hlo(lowered, devices: int, param_shapes=(), compile=None):
    """(compiled executable, text of the HLO module right after SPMD partitioning, the
    `peak.Peak` of the optimized module). On one device, where nothing is partitioned, the
    text is the compiled module's. JAX's persistent compilation cache is off for this one
    compile: an executable loaded from it was never compiled here, so XLA would dump nothing.
    `compile(lowered, options)` compiles it elsewhere (`cross_compile`)."""
    options = {"xla_dump_to": "", "xla_dump_hlo_pass_re": _PARTITIONER}
    with tempfile.TemporaryDirectory(prefix="zerojax-hlo-") as tmp, _no_compilation_cache():
        options["xla_dump_to"] = tmp
        compiled = compile(lowered, options) if compile else lowered.compile(options)
        peak = explain_peak(tmp, param_shapes)
        found = sorted(
            f
            for f in glob.glob(os.path.join(tmp, "*.txt"))
            if re.search(rf"after_(tpu-)?({_PARTITIONER})\.", os.path.basename(f))
        )
        if not found and devices == 1:
            return compiled, compiled.as_text(), peak  # one device: nothing to partition
        if not found:
            raise RuntimeError(
                "XLA wrote no module after SPMD partitioning; cannot count "
                "collectives at their sent dtype."
            )
        with open(found[-1]) as f:
            return compiled, f.read(), peak


def _param_shapes(params) -> set:
    """Dims a gradient of each parameter can have: whole, one device's shard, one layer of a
    stacked (scanned) leaf."""
    shapes = set()
    for x in jax.tree_util.tree_leaves(params):
        shape = tuple(x.shape)
        shapes |= {shape, shape[1:]}
        sharding = getattr(x, "sharding", None)
        if sharding is not None and hasattr(sharding, "shard_shape"):
            shapes.add(tuple(sharding.shard_shape(shape)))
    return shapes


def build_report(zero, step, state, batch, *extra, dump_to: str | None = None) -> Report:
    """Memory and communication of one optimizer step. With k-step gradient accumulation the
    communication of the k-1 accumulate-only calls is added and the peak is the larger one.
    `dump_to` (a path prefix) writes the partitioned and the optimized HLO beside it."""
    compile = None
    if cross_compile.needed(zero):  # GPUs that drop memory kinds: lowered on CPU devices
        zero, step, (state, batch, *extra), compile = cross_compile.on_cpu_twin(
            zero, step, (state, batch, *extra)
        )
    with cross_compile.host_moves_lowered_on_cpu() if compile else contextlib.nullcontext():
        return _report(zero, step, (state, batch, *extra), dump_to, compile)


def _report(zero, step, args: tuple, dump_to: str | None, compile) -> Report:
    state, batch, *extra = args
    k = zero.config.accumulation_steps if zero.config.manages_update else 1
    call = split_call((state, batch, *extra), step.batch_argnum, step.static_argnums)
    lowered = step.lower(state, batch, *extra)  # first: it decides a provisional layout
    # the state as the step holds it (NNX objects: their dict state), on the decided layout
    tree = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
        call.state.tree,
        zero.state_shardings(call.state.tree),
    )
    shapes = _param_shapes(
        [
            x
            for p, x in zip(zero.plan(tree), jax.tree_util.tree_leaves(tree), strict=True)
            if p.category == PARAMS
        ]
    )
    compiled, hlo, peak = compile_with_partitioned_hlo(lowered, zero.mesh.size, shapes, compile)
    optimized = compiled.as_text()  # the scheduled program: dumped, and read for overlap
    if dump_to:
        for suffix, text in (
            (".partitioned.hlo.txt", hlo),
            (".optimized.hlo.txt", optimized),
        ):
            with open(dump_to + suffix, "w") as f:
                f.write(text)
    local = dict(zero.mesh.shape).get("local")  # devices per node on a ('node', 'local') mesh
    collectives = parse_collectives(hlo, zero.axis_size, local)
    scheduled = scheduled_collectives(optimized, zero.axis_size, local)
    flops = matmul_flops(hlo)
    mem = compiled.memory_analysis()
    temp = int(mem.temp_size_in_bytes)
    if k > 1:
        micro, micro_hlo, micro_peak = compile_with_partitioned_hlo(
            step.lower(state, batch, *extra, micro=True), zero.mesh.size, shapes, compile
        )
        collectives += parse_collectives(micro_hlo, zero.axis_size, local) * (k - 1)
        scheduled += scheduled_collectives(micro.as_text(), zero.axis_size, local) * (k - 1)
        flops += matmul_flops(micro_hlo) * (k - 1)
        if int(micro.memory_analysis().temp_size_in_bytes) > temp:
            temp, peak = int(micro.memory_analysis().temp_size_in_bytes), micro_peak
    resident, host, kept = resident_bytes(zero, tree)
    # CPU's memory_analysis counts host-memory arguments with the device's (its host fields
    # stay 0): take the offloaded state out of the arguments there
    host_args = int(mem.host_argument_size_in_bytes) or sum(host.values())
    device_args = int(mem.argument_size_in_bytes) - (
        0 if mem.host_argument_size_in_bytes else sum(host.values())
    )
    if peak is not None:  # offloaded state lives in host memory, not in the device's peak
        names = {PARAMS: "parameters", OTHER: "other state"}  # report.CATEGORIES -> peak's
        peak = peak.on_device({names.get(c, c) for c in host}, device_args + temp)
    # the step brings offloaded state to the device: all of it when the update runs there,
    # only the parameters when it runs on the host
    # (a GPU or TPU program holds those copies in its temporaries: nothing to add)
    streamed = host.get(PARAMS, 0) if zero.config.updates_on_host else sum(host.values())
    if compile or zero.mesh.devices.flat[0].platform != "cpu":
        streamed = 0
    return Report(
        stage=zero.config.stage,
        devices=zero.axis_size,
        resident=resident,
        host_resident=host,
        host_argument_bytes=host_args,
        streamed_bytes=streamed,
        kept_replicated=kept,
        argument_bytes=device_args,
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=temp,
        collectives=collectives,
        scheduled=scheduled,
        peak=peak,
        xla_flags=xla_flags.effective(),
        matmul_flops=flops,
    )
