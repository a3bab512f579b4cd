"""DeepSpeed JSON -> ZeroConfig options. The tables of `deepspeed_keys` say what each key does.

Every DeepSpeed key zerojax knows does exactly one of three things:
- ACTS: it sets a zerojax option (the entry's `act` says how);
- IGNORED: accepted, with one warning saying why it means nothing under XLA and what plays its
  role there;
- ERROR: refused, saying what is not supported and what to use instead.
A key DeepSpeed does not have fails, naming its section and the nearest valid key
(`strict=False` turns that into a warning). HF-style "auto" values take zerojax's default or,
for the batch keys, are inferred by DeepSpeed's batch arithmetic once the device count is known
(`batch_sizes`); `explain` reports the value chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from zerojax.core.deepspeed_blocks import explain_block
from zerojax.core.deepspeed_keys import (
    ACTS,
    AUTO,
    BF16,
    ERROR,
    FP16,
    IGNORED,
    OFFLOAD,
    TOP_LEVEL,
    ZERO_OPTIMIZATION,
    Key,
    Row,
    read_dtype,
    read_flag,
)
from zerojax.core.errors import ZeroError, closest, nearest, warn


def explain(
    data: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> tuple[list[Row], dict, list[str]]:
    """(a Row per key, the ZeroConfig options, names of unknown keys) for a DeepSpeed dict.
    Raises ZeroError for values that cannot be read and for ERROR keys. `defaults`
    (`ZeroConfig.defaults()`) gives the value an 'auto' key resolves to."""
    if not isinstance(data, Mapping):
        raise ZeroError(f"a DeepSpeed config is a JSON object; got {type(data).__name__}.")
    read = _Reading(defaults or {})
    read.walk(data, TOP_LEVEL, "", read.top)
    options = read.options
    if (
        "train_batch_size" in options
        and "micro_batch_size" in options
        and "gradient_accumulation_steps" not in options
    ):
        options["gradient_accumulation_steps"] = AUTO  # DeepSpeed infers it from the two
    return read.rows, options, read.unknown


@dataclasses.dataclass
class _Reading:
    """One DeepSpeed dict being read: a Row per key, the options its keys set, its unknown
    keys; `defaults`: the value an 'auto' key resolves to."""

    defaults: Mapping[str, Any]
    rows: list = dataclasses.field(default_factory=list)
    options: dict = dataclasses.field(default_factory=dict)
    unknown: list = dataclasses.field(default_factory=list)

    def walk(self, section: Mapping, table: dict, prefix: str, handle: Callable | None = None):
        """Each key of `section` by its entry in `table` (`handle(key, name, value)` reads an
        ACTS key instead of its entry's `act`)."""
        for key, value in section.items():
            name = f"{prefix}{key}"
            entry = table.get(key)
            if entry is None:
                self.unknown.append(_unknown(name, str(key), table))
                continue
            if entry.kind == ERROR:
                raise ZeroError(f"{name}: {entry.why}.")
            if entry.kind == IGNORED:
                self.rows.append(Row(name, IGNORED, entry.why))
                continue
            sets = handle(key, name, value) if handle else _act(entry, name, value)
            self.options.update(sets)
            what = ", ".join(f"{k}={v!r}" for k, v in sets.items()) or (
                "(its keys: above)" if isinstance(value, Mapping) else "(read with its block)"
            )
            self.rows.append(Row(name, ACTS, what + (" (from 'auto')" if value == AUTO else "")))

    def top(self, key, name, value) -> dict:
        """A top-level key: its section read, or the options it sets."""
        if key == "zero_optimization":
            if isinstance(value, bool):  # legacy form: true means stage 1
                return {"stage": 1 if value else 0}
            _section(name, value)
            self.walk(value, ZERO_OPTIMIZATION, name + ".", self.zero)
            return {}
        if key in ("fp16", "bf16", "bfloat16"):
            return self.precision(key, name, value)
        if key in ("optimizer", "scheduler"):  # the optax side: explained, built on request
            explained, strangers = explain_block(key, value)
            self.rows.extend(Row(k, ACTS, what) for k, what in explained)
            self.unknown.extend(_unknown(*stranger) for stranger in strangers)
            return {}
        if value == AUTO and key == "gradient_clipping":  # HF's "auto": your option, or ours
            return {"gradient_clipping": self.defaults.get("gradient_clipping", 0.0)}
        if key == "data_types":
            return self.data_types(name, value)
        return _act(TOP_LEVEL[key], name, value)

    def data_types(self, name, value) -> dict:
        _section(name, value)
        out = {}
        for sub, v in value.items():
            if sub != "grad_accum_dtype":
                self.unknown.append(_unknown(f"{name}.{sub}", sub, ["grad_accum_dtype"]))
            else:
                out["grad_accum_dtype"] = read_dtype(f"{name}.{sub}", v)
        return out

    def zero(self, key, name, value) -> dict:
        """A key of `zero_optimization`."""
        if key in ("offload_optimizer", "offload_param"):
            _section(name, value)
            self.walk(value, OFFLOAD, name + ".", lambda k, n, v: {})
            kept = {k: v for k, v in value.items() if k in ("device", "pin_memory")}
            return {key: kept}
        entry = ZERO_OPTIMIZATION[key]
        if value == AUTO:  # HF's "auto": zerojax's default, reported
            option = entry.why.split()[0]
            return {option: self.defaults[option]} if option in self.defaults else {}
        return _act(entry, name, value)

    def precision(self, key, name, value) -> dict:
        """The fp16 / bf16 block: enabled (true, false, or "auto": on when the `precision`
        option passed beside the config (else zerojax's default, fp32) is this block's)."""
        _section(name, value)
        enabled = automatic = value.get("enabled", False)
        if automatic == AUTO:
            enabled = self.defaults.get("precision") == ("fp16" if key == "fp16" else "bf16")
        read_flag(f"{name}.enabled", enabled)
        rest = {k: v for k, v in value.items() if k != "enabled"}
        table = FP16 if key == "fp16" else BF16
        if enabled is True:
            self.walk(rest, table, name + ".")
            precision = "fp16" if key == "fp16" else "bf16"
            if self.options.get("precision", precision) != precision:
                raise ZeroError("fp16 and bf16 are both enabled; enable one of them.")
            return {"precision": precision}
        scaling = [k for k in rest if table.get(k) and table[k].kind == ACTS]
        if scaling and automatic == AUTO:  # an HF template's block, off here: read, not used
            for k in scaling:
                why = f"{name} is off ('auto': precision is not {key})"
                self.rows.append(Row(f"{name}.{k}", IGNORED, why))
            rest = {k: v for k, v in rest.items() if k not in scaling}
        elif scaling:
            raise ZeroError(f"{name} sets {', '.join(scaling)} but is not enabled.")
        self.walk(rest, table, name + ".")
        return {}


def _act(entry: Key, name: str, value) -> dict:
    """The options an ACTS key sets."""
    assert entry.act is not None, f"{name}: an ACTS key reads its value"
    return entry.act(name, value)


def _sections() -> dict[str, Mapping]:
    """{dotted prefix: its table} for every section of a DeepSpeed config zerojax reads."""
    return {
        "": TOP_LEVEL,
        "zero_optimization.": ZERO_OPTIMIZATION,
        "zero_optimization.offload_optimizer.": OFFLOAD,
        "zero_optimization.offload_param.": OFFLOAD,
        "fp16.": FP16,
        "bf16.": BF16,
        "data_types.": {"grad_accum_dtype": None},
    }


def _unknown(name: str, key: str, valid) -> str:
    """'unknown DeepSpeed key NAME' and the likeliest meant key: the nearest in its section,
    else the same or nearest key of another section, else the keys its section takes."""
    hint = nearest(key, valid)
    if not hint:
        elsewhere = {p + k: k for p, table in _sections().items() for k in table}
        same = [full for full, k in elsewhere.items() if k == key]
        if same:
            hint = f" (it belongs in {' or '.join(same)})"
        else:
            close = closest(key, sorted(set(elsewhere.values())))
            match = [full for full, k in elsewhere.items() if k == close]
            section = name[: -len(key) - 1] or "the top level"
            hint = (
                f" (did you mean {match[0]!r}?)"
                if match
                else f" ({section} takes: {', '.join(sorted(valid))})"
            )
    return f"unknown DeepSpeed key {name!r}{hint}"


def _section(name, value):
    if not isinstance(value, Mapping):
        raise ZeroError(f"{name} must be an object such as {{...}}; got {value!r}.")


def options_from_deepspeed(
    data: Mapping[str, Any], strict: bool = True, defaults: Mapping[str, Any] | None = None
) -> dict:
    """ZeroConfig keyword arguments for a DeepSpeed config dict: IGNORED keys warn once (one
    warning listing them all), unknown keys fail (strict) or warn."""
    rows, options, unknown = explain(data, defaults)
    if unknown:
        if strict:
            raise ZeroError(
                "; ".join(unknown) + ". zero_shard(config=..., strict=False) or "
                "ZeroConfig.from_json(..., strict=False) proceeds without them."
            )
        warn("zerojax proceeds WITHOUT these keys: " + "; ".join(unknown))
    ignored = [r for r in rows if r.kind == IGNORED]
    if ignored:
        warn(
            "zerojax accepts these DeepSpeed keys but they have no effect here:\n"
            + "\n".join(f"  {r.key}: {r.what}" for r in ignored)
        )
    return options
