"""What a compiled step spends beside its math, read from its optimized HLO text: how many
collectives it runs (after the compiler combined them: one instruction moving several arrays,
as XLA's combiners make, is one launch and counts once) and how small they are, which
all-gathers wait for something other than the stored shard they gather (a false dependency
keeps the scheduler from issuing them a unit ahead), and how many bytes are transposed, copied,
sliced or concatenated next to a collective (a weight split on a dimension other than its
first is re-laid out before and after every gather and reduce-scatter; leaves packed into one
buffer are copied in, and read back out of the gathered buffer).

A transpose between a matmul and a collective that moves blocks of rows (`splits_rows`) is
the matmul's, not the collective's: a plain `jax.jit` step transposes the stored leaf the same
way (XLA:CPU lays each attention q/k/v kernel `[d, heads, head_dim]` out as
`[heads * head_dim, d]` for backward's input gradient, and writes its weight gradient
transposed). Those bytes are counted apart (`matmul_transpose_bytes`). A move beside a
collective split past its array's first dimension, or one that copies, slices or concatenates
without transposing, is the collective's.

Every count is per execution of the module: an instruction in a scanned loop's body counts
once per iteration (`hlo.runs`). An all-gather's operand is followed back through every
instruction that computes it; it "comes from storage" when that ancestry reaches only the
step's arguments, constants, loop-invariant elements of a loop's state and integer scalars
(loop counters), with no matmul, indexing gather or carried floating-point value on the way.
At stage 3 every all-gather is a weight's; at stages 1-2 the parameters an update computed
are gathered after it, which by this reading do not come from storage either.
"""

from __future__ import annotations

import dataclasses
import re

from zerojax.inspect.hlo import Instruction, collectives_in, instruction, runs

SMALL = 64 * 1024  # bytes: a collective below this mostly pays its latency
_INDEX = re.compile(r"index=(\d+)")
_PARAMETER = re.compile(r"parameter\((\d+)\)")
_DIMENSION = re.compile(r"dimensions=\{(\d+)\}")
MATMULS = frozenset({"dot", "convolution"})
COMPUTES = MATMULS | {"gather", "scatter", "reduce-window"}
RELAYOUTS = frozenset({"transpose", "copy", "slice", "concatenate"})
PLUMBING = frozenset({"parameter", "constant", "bitcast", "reshape", "broadcast", "tuple"})
GATHERS = frozenset({"all-gather", "all-gather-start"})
REDUCTIONS = frozenset({"reduce-scatter", "all-reduce", "all-reduce-start", "all-to-all"})


def _number(pattern: re.Pattern, line: str) -> int:
    """The number `pattern` reads from `line` (a tuple index, a parameter's), -1 if none."""
    m = pattern.search(line)
    return int(m.group(1)) if m else -1


def splits_rows(instr: Instruction) -> bool:
    """Whether a collective gathers or scatters blocks of its array's rows: every dimension
    before its `dimensions={k}` has size 1 (an all-reduce moves its array whole). Then its
    shards lie end to end in the array's row-major order and it needs no re-layout."""
    k = _number(_DIMENSION, instr.line)
    shapes = re.findall(r"\[([\d,]*)\]", instr.result)
    if k <= 0 or not shapes:
        return True
    return all(int(d) == 1 for d in shapes[0].split(",")[:k])


@dataclasses.dataclass(frozen=True)
class Audit:
    """A compiled step's collectives and what surrounds them (see the module docstring)."""

    collectives: dict[str, int]  # kind: executions per step
    collective_bytes: dict[str, int]  # kind: buffer bytes per step
    small_in_loops: int  # executions per step of collectives under SMALL inside a loop body
    gathers_not_from_storage: tuple[str, ...]  # all-gathers waiting for a computed value
    gathered_bytes: int  # all-gather results, per step
    relayout_bytes: int  # data moves (RELAYOUTS) a collective's layout makes, per step
    matmul_transpose_bytes: int  # transposes between a collective and a matmul, per step


class _Module:
    """The instructions of an HLO module by computation, with how often each runs."""

    def __init__(self, hlo_text: str):
        lines, self.times = runs(hlo_text)
        self.comps = {
            comp: {i.name: i for i in map(instruction, body) if i is not None}
            for comp, body in lines.items()
        }
        self.caller: dict[str, tuple[str, Instruction]] = {}  # body or callee: (comp, instr)
        self.users: dict[tuple[str, str], list[Instruction]] = {}
        self._fused: dict[str, set[str]] = {}  # fused computation: the opcodes it runs
        for comp, instrs in self.comps.items():
            for instr in instrs.values():
                if instr.callee and instr.opcode in ("while", "call"):
                    self.caller[instr.callee] = (comp, instr)
                for operand in instr.operands:
                    self.users.setdefault((comp, operand), []).append(instr)

    def opcodes(self, instr: Instruction) -> set[str]:
        """What `instr` computes: its opcode, or every opcode of the computation it fuses
        (read once per computation: every walk back from a collective asks again)."""
        callee = instr.callee
        if instr.opcode not in ("fusion", "while") or callee not in self.comps:
            return {instr.opcode}
        if callee not in self._fused:
            self._fused[callee] = {
                op for i in self.comps[callee].values() for op in self.opcodes(i)
            }
        return self._fused[callee]

    def invariant(self, body: str, index: int) -> bool:
        """Whether a loop body passes element `index` of its state through unchanged."""
        root = [i for i in self.comps[body].values() if i.line.lstrip().startswith("ROOT")]
        if not root or root[0].opcode != "tuple" or index >= len(root[0].operands):
            return False
        passed = self.comps[body].get(root[0].operands[index])
        return (
            passed is not None
            and passed.opcode == "get-tuple-element"
            and self.comps[body].get(passed.operands[0], passed).opcode == "parameter"
            and _number(_INDEX, passed.line) == index
        )

    def computed(self, comp: str, name: str, seen: set | None = None) -> bool:
        """Whether `name` in `comp` depends on a matmul, an indexing gather or a carried
        floating-point loop value (see the module docstring)."""
        seen = set() if seen is None else seen
        if (comp, name) in seen or name not in self.comps.get(comp, {}):
            return False
        seen.add((comp, name))
        instr = self.comps[comp][name]
        if self.opcodes(instr) & COMPUTES:
            return True
        if instr.opcode == "get-tuple-element":
            source = self.comps[comp].get(instr.operands[0])
            if source is not None and source.opcode == "parameter" and comp in self.caller:
                return self._through_caller(comp, instr, seen)
        if instr.opcode == "parameter" and comp in self.caller:
            outer, call = self.caller[comp]
            if call.opcode == "call":
                k = _number(_PARAMETER, instr.line)
                return 0 <= k < len(call.operands) and self.computed(outer, call.operands[k], seen)
        return any(self.computed(comp, operand, seen) for operand in instr.operands)

    def _through_caller(self, body: str, element: Instruction, seen: set) -> bool:
        """A loop body's state element: invariant, it is what the loop was given; carried,
        a floating-point value is computed by the loop (an integer scalar is its counter)."""
        outer, loop = self.caller[body]
        index = _number(_INDEX, element.line)
        if loop.opcode != "while":
            return self.computed(outer, loop.operands[0], seen)
        if not self.invariant(body, index):
            return not re.fullmatch(r"[su]\d+\[\](\{.*\})?", element.result)
        init = self.comps[outer].get(loop.operands[0])
        if init is not None and init.opcode == "tuple" and index < len(init.operands):
            return self.computed(outer, init.operands[index], seen)
        return self.computed(outer, loop.operands[0], seen)

    def relayout(self, instr: Instruction) -> int:
        """Bytes of `instr` when it only moves data (a transpose, copy, slice or concatenation,
        alone or fused with nothing that computes: an update fused with a copy is math)."""
        ops = self.opcodes(instr)
        return instr.bytes if ops & RELAYOUTS and ops <= RELAYOUTS | PLUMBING else 0

    def for_matmul(self, move: Instruction, collective: Instruction, reads: list) -> bool:
        """Whether `move`, beside `collective`, is a matmul's transpose (see the module
        docstring): it transposes and neither slices nor concatenates, the collective moves
        blocks of rows, and `reads` (the move's users after a gather, its operands before a
        reduction) are all matmuls."""
        ops = self.opcodes(move)
        return (
            "transpose" in ops
            and not ops & {"slice", "concatenate"}
            and splits_rows(collective)
            and bool(reads)
            and all(self.opcodes(r) & MATMULS for r in reads)
        )


def audit(hlo_text: str, num_devices: int) -> Audit:
    """The `Audit` of a compiled HLO module (the optimized program, what the device runs:
    `Report`'s `dump_to` writes it) partitioned over `num_devices` devices."""
    module = _Module(hlo_text)
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    small = relayout = matmul = 0
    not_stored = []
    for comp, instrs in module.comps.items():
        times = module.times.get(comp, 0)
        for instr in instrs.values():
            moved = collectives_in(instr.line, num_devices, num_devices)
            if moved:  # one launch, however many arrays it moves
                kind, nbytes = moved[0].kind, sum(c.buffer_bytes for c in moved)
                counts[kind] = counts.get(kind, 0) + times
                sizes[kind] = sizes.get(kind, 0) + nbytes * times
                small += times if times > 1 and nbytes < SMALL else 0
            if instr.opcode not in GATHERS | REDUCTIONS:
                continue
            source = module.comps[comp].get(instr.operands[0]) if instr.operands else None
            around: list[tuple[Instruction, list]] = []  # (one beside it, what that one reads)
            if source is not None:
                inputs = [module.comps[comp].get(o) for o in source.operands]
                around.append((source, [i for i in inputs if i is not None]))
            for user in module.users.get((comp, instr.name), []):  # an async one's: its -done's
                done = user.opcode.endswith("-done")
                for near in module.users.get((comp, user.name), []) if done else [user]:
                    around.append((near, module.users.get((comp, near.name), [])))
            for near, reads in around:
                copied = times * module.relayout(near)
                if module.for_matmul(near, instr, reads):
                    matmul += copied
                else:
                    relayout += copied
            if instr.opcode in GATHERS and any(module.computed(comp, o) for o in instr.operands):
                not_stored.append(instr.name)
    return Audit(
        collectives=counts,
        collective_bytes=sizes,
        small_in_loops=small,
        gathers_not_from_storage=tuple(not_stored),
        gathered_bytes=sizes.get("all-gather", 0),
        relayout_bytes=relayout,
        matmul_transpose_bytes=matmul,
    )
