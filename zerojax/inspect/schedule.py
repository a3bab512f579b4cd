"""Which collectives the compiled schedule hides behind compute, read from the scheduled module.

An accelerator compiler splits a collective into a start and a done and schedules other work
between them; the collective is *overlapped* when a matmul (a `dot` or `convolution`, directly
or inside a fusion, loop or call, or XLA:GPU's cuBLAS / cuDNN custom-call; its Triton gemms are
fusions holding a `dot`) is scheduled between its start and its done, and *exposed* otherwise:
a synchronous collective always is. Host transfers (`copy-start` / `copy-done` to or from host
memory, `S(5)`, as host offload compiles on GPU) are read the same way, as kinds
'device-to-host' / 'host-to-device'. This reads XLA's async pairs (`all-gather-start`
/ `all-gather-done`, `async-start` / `async-done`) and the TPU compiler's
(`async-collective-start.N` / `async-collective-done.N` fusions, whose matmuls may be fused with
the collective's steps). XLA's CPU compiler schedules every collective synchronously, so on CPU
everything is exposed: the figure means something for a GPU or TPU program (`zerojax plan
--topology`). Collectives inside a while loop count once per iteration, as in `report`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from zerojax.inspect.hlo import (
    COLLECTIVES,
    Collective,
    arrays_bytes,
    callees,
    collectives_in,
    defines,
    opcode,
    split_computations,
    trip_count,
    tuple_elements,
    while_parts,
)

_MATMUL = ("dot", "convolution")
# XLA:GPU's library matmuls: cuBLAS(Lt) gemms and cuDNN convolutions / fused gemms
_LIBRARY_MATMUL = re.compile(r'custom_call_target="__(cublas|cudnn)\$')
TRANSFERS = ("device-to-host", "host-to-device")
_HOST_SPACE = ":S(5)"  # XLA's memory space of host memory, in a layout


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One collective of the scheduled program, and whether a matmul runs while it does."""

    collective: Collective
    overlapped: bool
    first: bool = True  # False for the second and later arrays one instruction moves


def _each(found: list[Collective], overlapped: bool) -> list[Scheduled]:
    """The arrays one collective instruction moves, the first marked as the launch."""
    return [Scheduled(c, overlapped, i == 0) for i, c in enumerate(found)]


def launches(scheduled: list[Scheduled]) -> list[tuple[str, int]]:
    """(kind, bytes of all its arrays) of each collective instruction run: a variadic or
    combined one is one launch, however many arrays it moves."""
    out: list[tuple[str, int]] = []
    for s in scheduled:
        if s.collective.kind in TRANSFERS:
            continue
        if s.first or not out:
            out.append((s.collective.kind, s.collective.buffer_bytes))
        else:
            out[-1] = (out[-1][0], out[-1][1] + s.collective.buffer_bytes)
    return out


def scheduled_collectives(hlo_text: str, num_devices: int, local: int | None = None):
    """Every collective the scheduled module runs (once per loop iteration), each marked
    overlapped or exposed."""
    comps, entry = split_computations(hlo_text)
    reader = _ScheduleReader(comps, num_devices, local or num_devices)
    return reader.walk(entry, ()) if entry else []


class _ScheduleReader:
    """Walks a scheduled module's computations in order, pairing each async collective's
    start with its done and noting whether a matmul was scheduled between them."""

    def __init__(self, comps: dict, num_devices: int, local: int):
        self.comps, self.num_devices, self.local = comps, num_devices, local
        self.has_matmul = functools.cache(self._has_matmul)

    def collectives(self, line: str) -> list[Collective]:
        return collectives_in(line, self.num_devices, self.local)

    def callees(self, line: str) -> list[str]:
        return [c for c in callees(line) if c in self.comps]

    def _has_matmul(self, comp: str) -> bool:
        for line in self.comps.get(comp, ()):
            found = defines(line)
            if found and self.is_matmul(line, opcode(found[1])):
                return True
        return False

    def is_matmul(self, line: str, op: str) -> bool:
        """Whether the instruction `line` runs a matmul, itself or in what it calls."""
        if op in _MATMUL or (op == "custom-call" and _LIBRARY_MATMUL.search(line)):
            return True
        return any(map(self.has_matmul, self.callees(line)))

    def started(self, line: str) -> list[Collective]:
        """The collective an async start runs: on its own line, or first in the computation
        it calls (XLA's async-start, the TPU compiler's start fusion)."""
        if found := self.collectives(line):
            return found
        for callee in self.callees(line):
            for callee_line in self.comps[callee]:
                if found := self.collectives(callee_line):
                    return found
        return []

    def fused(self, comp: str) -> list[Scheduled]:
        """The collectives of a fused computation (synchronous). The TPU compiler's
        'all-reduce-scatter' fusion combines reduce-scatters into one all-reduce whose result
        it slices: it runs the reduce-scatter half, and is counted as the reduce-scatter it
        is."""
        out = []
        for line in self.comps[comp]:
            found = self.collectives(line)
            if comp.startswith("all-reduce-scatter"):
                found = [dataclasses.replace(c, kind="reduce-scatter") for c in found]
            out += _each(found, False)
        return out

    def walk(self, comp: str, seen: tuple) -> list[Scheduled]:
        out: list[Scheduled] = []
        pending: dict[str, list[Collective]] = {}  # started, not done: by start name
        beside_matmul: set[str] = set()  # of those, the ones a matmul was scheduled after
        for line in self.comps.get(comp, ()):
            found = defines(line)
            if not found:
                continue
            name, rhs = found
            op = opcode(rhs)
            if op == "copy-start" and _HOST_SPACE in rhs:
                pending[name] = [_transfer(rhs)]
                continue
            if op.endswith("-start") or name.startswith("async-collective-start"):
                if started := self.started(line):
                    pending[name] = started
                    continue
            if (key := _done_of(name, op, rhs)) in pending:
                out += _each(pending.pop(key), key in beside_matmul)
                continue
            if op in COLLECTIVES:  # synchronous: nothing runs beside it
                out += _each(self.collectives(line), False)
                continue
            out += self.nested(line, op, rhs, comp, seen)
            if self.is_matmul(line, op):
                beside_matmul |= pending.keys()
        # a start whose done this computation does not hold (e.g. across a loop boundary):
        # counted, as exposed (nothing here is known to run beside it)
        return out + [s for found in pending.values() for s in _each(found, False)]

    def nested(self, line: str, op: str, rhs: str, comp: str, seen: tuple) -> list[Scheduled]:
        """The collectives of what `line` calls: a fusion's (synchronous), a loop body's
        (times its trips), a call's or a conditional branch's (in order)."""
        if op == "fusion":  # collectives fused synchronously, e.g. TPU's reduce-scatters
            return [  # not an in-flight one's step
                s
                for callee in self.callees(line)
                if not callee.startswith("async_collective")
                for s in self.fused(callee)
            ]
        loop = while_parts(line) if op == "while" else None
        if loop and loop[1] not in seen:
            trips = trip_count(line, self.comps.get(loop[0], []))
            return self.walk(loop[1], seen + (comp,)) * trips
        if op in ("call", "conditional"):
            return [
                s
                for callee in self.callees(line)
                if callee not in seen
                for s in self.walk(callee, seen + (comp,))
            ]
        return []


def _transfer(rhs: str) -> Collective:
    """The host transfer a `copy-start` runs: its result is (destination, source, context), the
    destination in host memory for a device-to-host copy."""
    destination = tuple_elements(rhs.split(" copy-start(")[0])[0]
    kind = TRANSFERS[0] if _HOST_SPACE in destination else TRANSFERS[1]
    (dtype, nbytes), *_ = arrays_bytes(destination)
    return Collective(kind, dtype, nbytes, group_size=1)


def _done_of(name: str, op: str, rhs: str) -> str | None:
    """The start an async done instruction completes (None for any other instruction)."""
    if name.startswith("async-collective-done"):
        return name.replace("-done", "-start")
    if op.endswith("-done"):
        operand = re.search(r"-done\(%?([\w.\-]+)", rhs)
        return operand and operand.group(1)
    return None


def overlap_bytes(scheduled: list[Scheduled], kind: str | None = None) -> tuple[float, float]:
    """(bytes one device sends in overlapped collectives, in exposed ones) per step; of one
    `kind` ('reduce-scatter', ...) only, when given (host transfers: see `host_transfers`)."""
    chosen = [s for s in scheduled if s.collective.kind in ((kind,) if kind else COLLECTIVES)]
    hidden = sum(s.collective.sent_bytes for s in chosen if s.overlapped)
    return hidden, sum(s.collective.sent_bytes for s in chosen) - hidden


def host_transfers(scheduled: list[Scheduled]) -> dict[str, tuple[int, int]]:
    """{'device-to-host' / 'host-to-device': (bytes copied while a matmul runs, bytes copied
    with none beside them)} per device per step."""
    out = {}
    for kind in TRANSFERS:
        moved = [s for s in scheduled if s.collective.kind == kind]
        hidden = sum(s.collective.buffer_bytes for s in moved if s.overlapped)
        out[kind] = (hidden, sum(s.collective.buffer_bytes for s in moved) - hidden)
    return out
