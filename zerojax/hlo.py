"""Reading XLA's HLO text: the collectives an HLO module runs (kind, dtype, buffer bytes, device
groups, bytes one device sends under the usual ring algorithms: all-reduce 2(g-1)/g of the
buffer, all-gather / reduce-scatter / all-to-all (g-1)/g, collective-permute all of it, g being
the replica-group size), its computations, and loop trip counts. `report` and `schedule` read
compiled programs with it.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# HLO array types: pred, or a kind (s, u, f, bf) and a width in bits (s4 ... f64)
_DTYPE = r"pred|bf16|[suf]\d+"
_OP = re.compile(
    r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<op>"
    + "|".join(COLLECTIVES)
    + r")(?P<start>-start)?\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_ARRAY = re.compile(rf"\b({_DTYPE})\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program."""

    kind: str
    dtype: str
    buffer_bytes: int  # the full buffer: all-reduce operand, all-gather output, RS input
    group_size: int
    cross_node: bool = False  # a replica group spans two nodes of a ('node', 'local') mesh

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends for it under ring algorithms."""
        g = self.group_size
        if g <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(
            self.kind, (g - 1) / g
        )
        return self.buffer_bytes * factor


def _itemsize(dtype: str) -> float:
    """Bytes per element of an HLO array type ('s4': half a byte)."""
    return 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype)) / 8


def _arrays_bytes(text: str):
    """(dtype, bytes) of every array type in an HLO shape string."""
    return [
        (dt, int(math.prod(int(d) for d in dims.split(",") if d) * _itemsize(dt)))
        for dt, dims in _ARRAY.findall(text)
    ]


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`,
    mesh axes `mesh['node'=2,'local'=4] {'local'}` (device ids in mesh order), source-target
    pairs of a permute, or all devices when it names none."""
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{}]*\})\}", attrs)
    if m:
        return [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        over = [a for a, _ in axes if f"'{a}'" in m.group(2)]
        ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes])
        order = [i for i, (a, _) in enumerate(axes) if a not in over] + [
            i for i, (a, _) in enumerate(axes) if a in over
        ]
        size = math.prod(n for a, n in axes if a in over)
        return ids.transpose(order).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    return [list(range(num_devices))]


def collectives_in(line: str, num_devices: int, local: int) -> list[Collective]:
    m = _OP.search(line)
    if not m:
        return []
    groups = replica_groups(m.group("attrs"), num_devices)
    kind = m.group("op")
    group = 2 if kind == "collective-permute" else len(groups[0])
    cross = any(len({i // local for i in g}) > 1 for g in groups)
    results = _arrays_bytes(m.group("result"))
    if m.group("start") and kind == "all-gather":  # result tuple is (operands, outputs)
        results = results[len(results) // 2 :]
    # Read from the results: a reduce-scatter's full buffer is g times its result.
    arrays = [(dt, b * group) for dt, b in results] if kind == "reduce-scatter" else results
    return [Collective(kind, dtype, nbytes, group, cross) for dtype, nbytes in arrays]


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|branch_computations)=\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def trip_count(line: str, condition: list[str]) -> int:
    """Iterations of a while loop: XLA's known_trip_count, else the bound of the `i < N`
    compare in a JAX-style (scan / fori_loop) condition, else 1."""
    m = _TRIP.search(line)
    if m:
        return int(m.group(1))
    bound = r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)"  # a TPU module adds a layout: {:T(128)}
    consts = [int(c) for text in condition for c in re.findall(bound, text)]
    lt = any("direction=LT" in text for text in condition)
    return consts[0] if lt and len(consts) == 1 else 1


def split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """({computation name: its instruction lines}, the entry computation's name or None)."""
    computations: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line[:1].isspace():  # headers start in column 0, instructions not
            name = m.group(2)
            computations[name] = []
            entry = name if m.group(1) else entry
        elif name is not None:
            computations[name].append(line)
    return computations, entry


def parse_collectives(
    hlo_text: str, num_devices: int, local: int | None = None
) -> list[Collective]:
    """Every collective an HLO module executes, as often as it executes: collectives inside a
    while loop (a scanned layer stack) count once per iteration. Async `-start` halves count
    once, `-done` halves not at all. `local`: devices per node (device ids in mesh order), to
    mark the collectives whose groups cross nodes; None: one node."""
    local = local or num_devices
    computations, entry = split_computations(hlo_text)

    def walk(comp: str, seen: tuple) -> list[Collective]:
        found = []
        for line in computations.get(comp, []):
            found += collectives_in(line, num_devices, local)
            loop = _WHILE.search(line)
            if loop and loop.group(2) not in seen:
                trips = trip_count(line, computations.get(loop.group(1), []))
                found += walk(loop.group(2), seen + (comp,)) * trips
                continue
            for m in _CALLS.finditer(line):
                for callee in re.split(r",\s*%?", m.group(1)):
                    if callee in computations and callee not in seen:
                        found += walk(callee, seen + (comp,))
        return found

    if entry is None:  # a bare list of instructions (no computations)
        return [
            c for line in hlo_text.splitlines() for c in collectives_in(line, num_devices, local)
        ]
    return walk(entry, ())
