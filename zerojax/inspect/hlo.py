"""Reading XLA's HLO text: the collectives an HLO module runs (kind, dtype, buffer bytes, device
groups, bytes one device sends under the usual ring algorithms: all-reduce 2(g-1)/g of the
buffer, all-gather / reduce-scatter / all-to-all (g-1)/g, collective-permute all of it, g being
the replica-group size), its computations, and loop trip counts. `report` and `schedule` read
compiled programs with it.
"""

from __future__ import annotations

import dataclasses
import functools
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
ARRAY = re.compile(rf"\b({_DTYPE})\[([\d,]*)\]")  # an array type: (dtype, dims)


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


def arrays_bytes(text: str):
    """(dtype, bytes) of every array type in an HLO shape string."""
    return [
        (dt, int(math.prod(int(d) for d in dims.split(",") if d) * _itemsize(dt)))
        for dt, dims in ARRAY.findall(text)
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
    result = m.group("result")
    results = arrays_bytes(start_outputs(result, kind) if m.group("start") else result)
    # Read from the results: a reduce-scatter's full buffer is g times its result.
    arrays = [(dt, b * group) for dt, b in results] if kind == "reduce-scatter" else results
    return [Collective(kind, dtype, nbytes, group, cross) for dtype, nbytes in arrays]


def tuple_elements(shape: str) -> list[str]:
    """The elements of a tuple shape '(a, (b, c), d)', split at its top-level commas (layouts'
    braces and tiles' parentheses kept whole; `/*index=5*/` comments dropped)."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if (depth == 1 and ch == ",") or depth == 0:
            parts.append(re.sub(r"/\*.*?\*/", "", shape[start:i]).strip())
            start = i + 1
        if depth == 0:
            break
    return parts


def start_outputs(result: str, kind: str) -> str:
    """The outputs of an async collective start from its result shape. XLA:GPU's starts return
    ((operands...), outputs...): an all-reduce-start `((f32[n]), f32[n])`, a reduce-scatter's
    `((f32[8m]), f32[m])`, a combined all-gather's `((a, b), (A, B))`; the TPU compiler's
    all-gather-start returns (operands..., outputs...), its all-reduce-start the outputs."""
    parts = tuple_elements(result) if result.startswith("(") else [result]
    if parts[0].startswith("("):  # XLA:GPU: (operands tuple, outputs...)
        return ", ".join(parts[1:])
    return ", ".join(parts[len(parts) // 2 :] if kind == "all-gather" else parts)


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
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


def runs(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, int]]:
    """({computation: its instruction lines}, {computation: times it runs per execution of
    the module}), the latter in the order first reached from the entry: a while body once per
    iteration (`trip_count`), a called computation (fusion, call, reduction) once per call;
    both branches of a conditional count, an upper bound. A module with no entry is one
    computation, '', run once."""
    computations, entry = split_computations(hlo_text)
    if entry is None:
        return {"": hlo_text.splitlines()}, {"": 1}
    counts: dict[str, int] = {}

    def walk(comp: str, times: int, seen: tuple) -> None:
        counts[comp] = counts.get(comp, 0) + times
        for line in computations.get(comp, []):
            loop = while_parts(line)
            if loop and loop[1] not in seen:
                trips = trip_count(line, computations.get(loop[0], []))
                walk(loop[1], times * trips, seen + (comp,))
                continue
            for callee in callees(line, ("calls", "to_apply", "branch_computations")):
                if callee in computations and callee not in seen:
                    walk(callee, times, seen + (comp,))

    walk(entry, 1, ())
    return computations, counts


def executions(hlo_text: str) -> list[tuple[list[str], int]]:
    """(a computation's instruction lines, times it runs per execution of the module), in the
    order first reached from the entry (see `runs`)."""
    computations, counts = runs(hlo_text)
    return [(computations.get(comp, []), times) for comp, times in counts.items()]


def parse_collectives(
    hlo_text: str, num_devices: int, local: int | None = None
) -> list[Collective]:
    """Every collective an HLO module executes, as often as it executes: collectives inside a
    while loop (a scanned layer stack) count once per iteration. Async `-start` halves count
    once, `-done` halves not at all. `local`: devices per node (device ids in mesh order), to
    mark the collectives whose groups cross nodes; None: one node."""
    local = local or num_devices
    return [
        c
        for lines, times in executions(hlo_text)
        for line in lines
        for c in collectives_in(line, num_devices, local) * times
    ]


# a matmul's operands: the names before its first attribute (`lhs_contracting_dims=`, ...)
_MATMUL = re.compile(r"\s(dot|convolution)\(([^=]*)")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _tuple_type(rhs: str) -> str:
    """The element types of the tuple type `rhs` starts with (up to its matching parenthesis)."""
    depth = 0
    for i, char in enumerate(rhs):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rhs[1:i]
    return ""


def _shapes(lines: list[str]) -> dict[str, list[int]]:
    """{instruction name: its array result's dims} for one computation; a flat tuple's
    elements as `name#i`."""
    shapes = {}
    for line in lines:
        m = _DEFINES.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        if not rhs.startswith("("):
            if array := ARRAY.match(rhs):
                shapes[name] = _dims(array.group(2))
            continue
        elements = re.sub(r"\{[^}]*\}|/\*.*?\*/", "", _tuple_type(rhs))  # no layouts, comments
        if "(" not in elements:  # flat
            for i, (_, dims) in enumerate(ARRAY.findall(elements)):
                shapes[f"{name}#{i}"] = _dims(dims)
    return shapes


def matmul_flops(hlo_text: str) -> float:
    """Floating-point operations of the module's matmuls (`dot`, and `convolution`, as which the
    TPU compiler writes dots), each counted as often as it runs (a scanned layer's matmuls once
    per iteration, unlike `cost_analysis()`, which counts a loop body once): 2 x output elements
    x the products summed into each (a dot's contracting dimensions; a convolution's kernel
    elements per output feature: exact for a plain convolution, not for the dilated and padded
    ones a TPU compiler turns batched dots into, so read a TPU program's FLOPs from its
    partitioned module, before that rewrite). Per device, for a partitioned module."""
    total = 0.0
    for lines, times in executions(hlo_text):
        shapes = _shapes(lines)
        for line in lines:
            m, out = _MATMUL.search(line), _DEFINES.match(line)
            if not (m and out and out.group(1) in shapes):
                continue
            operands = re.findall(rf"%({_NAME})", m.group(2))
            if len(operands) < 2 or not {operands[0], operands[1]} <= shapes.keys():
                raise ValueError(f"cannot read the operand shapes of: {line.strip()[:200]}")
            lhs, rhs = shapes[operands[0]], shapes[operands[1]]
            if m.group(1) == "dot":
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
                per_output = math.prod(
                    lhs[i] for i in _dims(contracting.group(1) if contracting else "")
                )
            else:
                labels = re.search(r"dim_labels=\w+_(\w+)->", line)
                per_output = math.prod(rhs) // rhs[labels.group(1).index("o")] if labels else 0
            total += 2 * math.prod(shapes[out.group(1)]) * per_output * times
    return total


# ---- the one instruction grammar every reader of HLO text in inspect/ uses -------------------
_NAME = r"[\w.\-#]+"  # `#i` names element i of a tuple-valued instruction (shardy's modules)
_DEFINES = re.compile(rf"^\s*(?:ROOT\s+)?%?({_NAME})\s*=\s*(.*)$")
_WHILE = re.compile(r"\swhile\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
CALLING = ("calls", "to_apply", "body", "condition", "branch_computations")


def defines(line: str) -> tuple[str, str] | None:
    """(name, right-hand side) of an instruction line, None for any other line."""
    m = _DEFINES.match(line)
    return (m.group(1), m.group(2)) if m else None


@functools.cache
def _calling(attrs: tuple) -> re.Pattern:
    return re.compile(rf"(?:{'|'.join(attrs)})=\{{?%?([\w.\-]+(?:, %?[\w.\-]+)*)")


def callees(line: str, attrs: tuple = CALLING) -> list[str]:
    """The computations an instruction line names in `attrs` (fusion and call `calls`, a
    reduction's `to_apply`, a while's `condition` and `body`, a conditional's branches), in
    the order written."""
    return [c for m in _calling(attrs).finditer(line) for c in re.split(r",\s*%?", m.group(1))]


def while_parts(line: str) -> tuple[str, str] | None:
    """(condition, body) of a while instruction line, None for any other line."""
    m = _WHILE.search(line)
    return (m.group(1), m.group(2)) if m else None


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One line of an HLO computation: what it defines, from what."""

    name: str
    result: str  # its result type, as printed
    opcode: str
    operands: tuple[str, ...]
    line: str

    @property
    def bytes(self) -> int:
        return sum(b for _, b in arrays_bytes(self.result))

    @property
    def callee(self) -> str | None:
        """The computation it runs: a while's body, else what it calls or applies."""
        loop = while_parts(self.line)
        if loop is not None:
            return loop[1]
        found = callees(self.line, ("calls", "to_apply"))
        return found[0] if found else None


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def split_result(rhs: str) -> tuple[str, str]:
    """(result type, the rest: `opcode(operands), attributes`) of an instruction's right-hand
    side: a tuple type up to its closing parenthesis, an array type up to the first space."""
    end = _closing(rhs, 0) + 1 if rhs.startswith("(") else rhs.find(" ")
    return rhs[:end], rhs[end:].lstrip()


def opcode(rhs: str) -> str:
    """The opcode of an instruction's right-hand side, '' when it has none."""
    m = re.match(r"([\w\-]+)\(", split_result(rhs)[1])
    return m.group(1) if m else ""


def instruction(line: str) -> Instruction | None:
    """One HLO instruction line: `%name = type opcode(operands), attributes`."""
    found = defines(line)
    if not found:
        return None
    name, rhs = found
    result, rest = split_result(rhs)
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    args = rest[op.end() : _closing(rest, op.end() - 1)]
    operands = tuple(re.findall(r"%([\w.\-#]+)", args))
    return Instruction(name, result, op.group(1), operands, line)
