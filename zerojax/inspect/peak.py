"""What is alive at a compiled step's memory peak, read from XLA's own buffer live ranges.

XLA writes, beside each optimized module it dumps, the live range of every buffer and the set
alive at the peak (`*-live-range.txt`). `explain_peak` joins that set with the optimized HLO
(each buffer's shape, op name and source line) and sorts the buffers into categories: the state
the step received (parameters, master weights, optimizer state, gradient buffers, inputs: all
of it, since arguments stay allocated for the whole step) by its argument path, copies XLA
made of parameters (the CPU compiler converts 16-bit weights to f32), gathered unit weights
and collective buffers by the collective that made them, and the rest by the part of the
program that made them: forward (activations, also when recomputed in backward), backward
(gradients when shaped like a parameter or a shard of one, else backward temporaries), or the
optimizer update. Nothing is estimated: the bytes are XLA's.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import os
import re

from zerojax.comm.flat import COPY_OUT
from zerojax.inspect.hlo import ARRAY, defines, while_parts

CATEGORIES = (
    "parameters",
    "master weights",
    "optimizer state",
    "gradient buffers",
    "other state",
    "inputs",
    "parameter copies",
    "state copies",
    "gathered weights",
    "collective buffers",
    "activations",
    "gradients",
    "backward temporaries",
    "update temporaries",
    "other temporaries",
)

_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s*([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")
_SEQUENCE = re.compile(r"^\s*(\d+):([\w.\-]+)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_GATHER = ("all-gather", "all_gather")
_REDUCE = ("all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_REDUCE_NAMES = ("reduce_scatter", "psum_scatter", "psum", "all_to_all", "ppermute")
_LIBRARIES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# an instruction: (shape text, opcode, op_name, stack frame id, operand names)
Definition = tuple[str, str, str, "int | None", list]
_UNKNOWN: Definition = ("?", "", "", None, [])
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # zerojax/


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer alive at the peak."""

    name: str  # the HLO instruction that defines it ({index} for a tuple element)
    bytes: int
    shape: str
    category: str
    op_name: str  # JAX's name of the operation (or the argument's path)
    source: str  # file:line of the user's code that made it (see _source), if known
    reuses: str = ""  # the category of the dead argument whose memory XLA placed it in
    argument: bool = False  # a step argument (state or batch) itself


@dataclasses.dataclass
class Peak:
    """The buffers alive at the compiled peak and where in the program it occurs."""

    buffers: list  # Buffer, largest first; every step argument (allocated all step) included
    at: str  # the instruction executing at the peak, with its op name
    compiled_bytes: int  # the report's peak: device arguments + temporaries
    host_bytes: int = 0  # offloaded state arguments' memory (host), not in `buffers`

    def on_device(self, host_categories: set, compiled_bytes: int) -> Peak:
        """This peak with the arguments of `host_categories` (state offloaded to host memory,
        which the CPU compiler keeps in its one memory) taken out, and what that compile
        placed in their memory once they were dead, against `compiled_bytes`."""
        host = [
            b
            for b in self.buffers
            if (b.category in host_categories and b.argument) or b.reuses in host_categories
        ]
        return dataclasses.replace(
            self,
            buffers=[b for b in self.buffers if b not in host],
            compiled_bytes=compiled_bytes,
            host_bytes=sum(b.bytes for b in host),
        )

    @property
    def live_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    def by_category(self) -> dict:
        """{category: bytes alive at the peak}, in CATEGORIES order, non-zero only."""
        sums: collections.Counter[str] = collections.Counter()
        for b in self.buffers:
            sums[b.category] += b.bytes
        return {c: sums[c] for c in CATEGORIES if sums[c]}

    def format(self, top: int = 10) -> str:
        """The categories and the `top` largest buffers, in MiB (GiB from a 1 GiB peak)."""
        unit, unit_name = (2**30, "GiB") if self.compiled_bytes >= 2**30 else (2**20, "MiB")
        size = lambda b: f"{b / unit:10.3f}"
        total = self.live_bytes
        lines = [
            f"alive at the peak ({unit_name} per device), at {self.at}:",
            *(
                f"  {cat:<22}{size(b)}  {b / max(total, 1):6.1%}"
                for cat, b in self.by_category().items()
            ),
            f"  {'total':<22}{size(total)}  = {total / max(self.compiled_bytes, 1):.1%} of the "
            f"compiled peak {size(self.compiled_bytes).strip()} (the rest: gaps in XLA's packing "
            "of temporaries)",
            f"  of which {size(sum(b.bytes for b in self.buffers if b.reuses)).strip()} {unit_name}"
            " sit in the memory of step arguments XLA no longer needed (donated state)",
            *(
                [
                    f"  (offloaded state in host memory, not counted: "
                    f"{size(self.host_bytes).strip()})"
                ]
                if self.host_bytes
                else []
            ),
            f"largest {min(top, len(self.buffers))} buffers:",
        ]
        for b in self.buffers[:top]:
            where = f"  {b.source}" if b.source else ""
            lines.append(f"  {size(b.bytes)}  {b.category:<20} {b.shape:<24} {b.op_name}{where}")
        return "\n".join(lines) + "\n"


def explain_peak(dump_dir: str, param_shapes=()) -> Peak | None:
    """The peak of the step module XLA dumped into `dump_dir` after optimizations (None when it
    wrote no live ranges). `param_shapes`: dims of each parameter, whole and as one device
    holds it (a backward buffer of such a shape counts as a gradient)."""
    ranges = _largest(glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt")))
    if ranges is None:
        return None
    hlo_path = ranges.replace("-live-range.txt", ".txt")
    with open(ranges) as f:
        live, at_index, sequence = _live_at_peak(f)
    with open(hlo_path) as f:
        hlo = f.read()
    with open(ranges.replace("-live-range.txt", "-buffer-assignment.txt")) as f:
        allocation_of, sizes = _argument_allocations(f)
    module = _Module(hlo, {tuple(s) for s in param_shapes})
    owner = {allocation_of[n]: n for n in module.entry_parameters if n in allocation_of}
    buffers = []
    for name, index, size in live:
        buffer = module.buffer(name, index, size)
        home = owner.get(allocation_of.get(f"{name}{{{index}}}" if index else name))
        reused = module.category(home, None) if home not in (None, name) else ""
        if reused and reused != buffer.category:  # XLA placed it in a dead argument's memory
            buffer = dataclasses.replace(buffer, reuses=reused)
        buffers.append(buffer)
    # an argument's memory stays allocated for the whole step; XLA may reuse it for other
    # values once the argument is dead. What no value alive at the peak uses of it is still
    # held: counted as the argument's
    used: collections.Counter[int | None] = collections.Counter()
    for name, index, size in live:
        used[allocation_of.get(f"{name}{{{index}}}" if index else name)] += size
    for name in module.entry_parameters:
        allocation = allocation_of.get(name)
        if allocation is not None and sizes[allocation] > used[allocation]:
            buffers.append(module.buffer(name, "", sizes[allocation] - used[allocation]))
    buffers.sort(key=lambda b: -b.bytes)
    at_name = sequence.get(at_index, "?")
    at_op = module.defs.get(module.named(at_name), _UNKNOWN)[2]
    return Peak(buffers, f"{at_name} ({at_op or 'no op name'})", compiled_bytes=0)


def _argument_allocations(lines) -> tuple[dict, dict]:
    """From XLA's buffer assignment: ({value: allocation} for the values placed in an
    argument's allocation, {allocation: bytes})."""
    values, sizes, current = {}, {}, None
    for line in lines:
        # jax 0.12's XLA adds a page: "allocation 0: size 32768, page 0, parameter 4, ..."
        if m := re.match(r"^allocation (\d+): size (\d+),(?: page \d+,)? parameter \d+", line):
            current = int(m.group(1))
            sizes[current] = int(m.group(2))
        elif line.startswith("allocation"):
            current = None
        elif current is not None and (m := re.match(r"^ value: <\d+ (\S+)", line)):
            values[m.group(1)] = current
    return values, sizes


def _largest(paths):
    """The dump of the biggest module (the step; XLA also dumps small helper programs)."""
    return max(paths, key=os.path.getsize, default=None)


def _live_at_peak(lines):
    """([(name, shape index, bytes)] alive at the peak, the peak's position, {position: name})."""
    live, at, sequence, in_peak = [], None, {}, False
    for line in lines:
        if in_peak:
            m = _LIVE.match(line)
            if not m:
                break
            live.append((m.group(1), m.group(2), int(m.group(3))))
        elif m := _PEAK.match(line):
            at, in_peak = int(m.group(1)), True
        elif m := _SEQUENCE.match(line):
            sequence[int(m.group(1))] = m.group(2)
    return live, at, sequence


class _Module:
    """The optimized HLO module as `explain_peak` needs it: each instruction's (shape text,
    opcode, op_name, stack frame id, operand names), the entry computation's parameters, the
    while loop whose body each loop-body parameter belongs to, and the stack frames."""

    def __init__(self, hlo: str, param_shapes: set):
        self.defs: dict[str, Definition] = {}
        self.entry_parameters: list[str] = []
        self.loop_of: dict[str, str] = {}  # loop-body parameter -> its while instruction
        self.frames, self.param_shapes = _frames(hlo), param_shapes
        computation, entry, bodies = "", False, {}
        for line in hlo.splitlines():
            if line[:1] not in ("", " ", "}") and line.rstrip().endswith("{"):
                entry = line.startswith("ENTRY")
                computation = line.split()[1 if entry else 0].lstrip("%")
                continue
            found = defines(line)
            if not found:
                continue
            shape, after = _split_shape(found[1])
            opcode, _, args = after.partition("(")
            op_name, frame = _OP_NAME.search(after), _FRAME.search(after)
            name, opcode = found[0], opcode.strip()
            self.defs[name] = (
                shape,
                opcode,
                _one_name(op_name.group(1).replace("\\'", "'")) if op_name else "",
                int(frame.group(1)) if frame else None,
                re.findall(r"%([\w.\-]+)", _split_shape("(" + args)[0]),
            )
            if opcode == "parameter":
                if entry:
                    self.entry_parameters.append(name)
                else:
                    self.loop_of[name] = computation  # resolved to a loop below
            if opcode == "while" and (loop := while_parts(line)):
                bodies[loop[1]] = name
        self.loop_of = {p: bodies[c] for p, c in self.loop_of.items() if c in bodies}
        self.entry_set = set(self.entry_parameters)

    def buffer(self, name: str, index: str, size: int) -> Buffer:
        shape = _element(self.defs.get(name, _UNKNOWN)[0], index)
        _, _, op_name, frame, _ = self.defs.get(self.named(name), _UNKNOWN)
        return Buffer(
            name=name + (f"{{{index}}}" if index else ""),
            bytes=size,
            shape=shape,
            category=self.category(name, _dims(shape)),
            op_name=op_name,
            source=_source(self.frames.get(frame, ())),
            argument=name in self.entry_set,
        )

    def named(self, name: str, depth: int = 0) -> str:
        """`name`, or what it was made from that carries an op name: a loop body's parameter
        is its while loop's; an instruction XLA made without a name (a copy, a convert, a
        fusion) the nearest operand's (depth first, 8 deep)."""
        _, opcode, op_name, _, operands = self.defs.get(name, _UNKNOWN)
        if op_name or depth >= 8:
            return name
        if opcode == "parameter":
            return self.named(self.loop_of[name], depth + 1) if name in self.loop_of else name
        for operand in operands:
            if self.defs.get(operand, _UNKNOWN)[1] == "constant":
                continue
            found = self.named(operand, depth + 1)
            if self.defs.get(found, _UNKNOWN)[2]:
                return found
        return name

    def category(self, name: str, dims) -> str:
        """See the module docstring; a converted copy of a parameter is a 'parameter copy'."""
        named = self.named(name)
        _, opcode, op_name, frame, operands = self.defs.get(named, _UNKNOWN)
        if opcode == "parameter" and op_name and "/" not in op_name:
            arg = _argument_category(op_name)
            if named == name:
                return arg
            return "parameter copies" if arg == "parameters" else "state copies"
        last = op_name.rsplit("/", 1)[-1]
        if opcode.startswith("all-gather") or last in _GATHER or COPY_OUT in op_name:
            return "gathered weights"  # (COPY_OUT: the leaves read out of a unit's buffer)
        if opcode.split("-start")[0].split("-done")[0] in _REDUCE or last in _REDUCE_NAMES:
            return "collective buffers"
        transform = next(
            (c for c in reversed(op_name.split("/")) if c.startswith(("transpose(", "jvp("))), ""
        )
        if transform.startswith("transpose("):
            return "gradients" if dims in self.param_shapes else "backward temporaries"
        if transform.startswith("jvp("):  # forward, or its recomputation inside backward
            return "activations"
        if last == "sharding_constraint" and any(
            self.category(o, None) in ("parameters", "parameter copies") for o in operands
        ):
            return "parameter copies"
        chain = self.frames.get(frame, ())
        if any(
            "optax" in f[0] or f[0].endswith(os.path.join("zerojax", "engine", "optim.py"))
            for f in chain
        ):
            return "update temporaries"
        return "other temporaries"


def _one_name(op_name: str) -> str:
    """An instruction XLA merged from several keeps all their names, `prefix/(a:b:c)`: the
    first, and how many more."""
    m = re.fullmatch(r"(.*?/)\((.*)\)", op_name)
    if not m or ":" not in m.group(2):
        return op_name
    names = m.group(2).split(":")
    return f"{m.group(1)}{names[0]} (+{len(names) - 1} merged)"


def _bytes(shape: str) -> int:
    """Bytes of an HLO array shape ('bf16[4,8]{1,0}')."""
    m = ARRAY.match(shape)
    if not m:
        return 0
    width = 1 if m.group(1) == "pred" else int(re.sub(r"\D", "", m.group(1))) // 8 or 1
    return width * math.prod(int(d) for d in m.group(2).split(",") if d)


def _split_shape(text: str) -> tuple[str, str]:
    """(the result shape, the rest) of an instruction's right-hand side."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[: i + 1], text[i + 1 :].lstrip()
    return text, ""


def _element(shape: str, index: str) -> str:
    """The shape of tuple element `index` ('2' or '1,0') of `shape`; the shape when ''."""
    for i in (int(x) for x in index.split(",") if x):
        if not shape.startswith("("):
            return shape
        parts, depth, start = [], 0, 1
        for pos, ch in enumerate(shape[1:-1], start=1):
            depth += {"(": 1, ")": -1, "[": 1, "]": -1, "{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(shape[start:pos].strip())
                start = pos + 1
        parts.append(shape[start:-1].strip())
        shape = parts[i] if i < len(parts) else "?"
    return re.sub(r"\{[^}]*\}|/\*.*?\*/", "", shape).strip()  # drop layout and comments


def _dims(shape: str) -> tuple | None:
    m = ARRAY.fullmatch(shape)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else None


def _frames(hlo: str) -> dict:
    """{stack frame id: [(file, line, function), ...] innermost first} from the module's
    FileNames / FunctionNames / FileLocations / StackFrames tables. A printed parent id is
    the parent's id + 1 (0: no parent)."""
    tables: dict[str, dict[int, str]] = {
        k: {} for k in ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    }
    current = None
    for line in hlo.splitlines():
        if line in tables:
            current = tables[line]
        elif current is not None and (m := re.match(r"^(\d+) (.*)$", line)):
            current[int(m.group(1))] = m.group(2)
        elif current is not None and not line.strip():
            current = None
    files, funcs = tables["FileNames"], tables["FunctionNames"]

    def field(text: str, key: str) -> int:
        m = re.search(rf"{key}=(\d+)", text)
        return int(m.group(1)) if m else 0

    locations = {
        k: (
            files.get(field(v, "file_name_id"), "?").strip('"'),
            field(v, "line"),
            funcs.get(field(v, "function_name_id"), "?").strip('"'),
        )
        for k, v in tables["FileLocations"].items()
    }
    raw = {
        k: (field(v, "file_location_id"), field(v, "parent_frame_id") - 1)
        for k, v in tables["StackFrames"].items()
    }
    out = {}
    for frame in raw:
        chain, seen, f = [], set(), frame
        while f in raw and f not in seen:
            seen.add(f)
            chain.append(locations.get(raw[f][0], ("?", 0, "?")))
            f = raw[f][1]
        out[frame] = chain
    return out


def _source(chain) -> str:
    """file:line of the innermost frame in model or user code: outside the installed
    libraries and zerojax's engine (its example models count as model code), else ''."""
    models = os.path.join(_PACKAGE, "models") + os.sep
    library = lambda path: (
        any(lib in path for lib in _LIBRARIES)
        or (path.startswith(_PACKAGE) and not path.startswith(models))
    )
    pick = next((f for f in chain if not library(f[0])), None)
    if pick is None:
        return ""
    path = os.path.relpath(pick[0]) if pick[0].startswith(os.getcwd()) else pick[0]
    return f"{path}:{pick[1]} ({pick[2]})"


def _argument_category(path: str) -> str:
    """Category of a step argument from its path (`state.params['w']`, `batch['x']`...)."""
    if not path.startswith("state"):
        return "inputs"
    if ".master" in path:
        return "master weights"
    if ".accum" in path or ".per_device" in path:
        return "gradient buffers"
    if "opt_state" in path:
        return "optimizer state"
    if "params" in path:
        return "parameters"
    return "other state"
