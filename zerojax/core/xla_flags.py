"""XLA flags zerojax sets by default, before JAX starts its backend.

On GPU, XLA's latency-hiding scheduler lets a layer's gradient reduce-scatter (and, with
prefetch, the next layer's all-gather) run while other layers compute; the collective
pipeliner does the same across the iterations of a scanned layer stack. The flag is harmless on
CPU and TPU. A value you already put in XLA_FLAGS wins; ZEROJAX_DEFAULT_XLA_FLAGS=0 turns the
defaults off. `effective()` says what is in force, and every report records it.
"""

from __future__ import annotations

import os
import sys

DEFAULTS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # scanned stage-3 layers: move the next iteration's weight gather (and this iteration's
    # gradient reduce-scatter) across the loop boundary, i.e. prefetch one layer
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
}
# `zerojax plan` only: it compiles on the CPU to predict accelerator memory. The CPU compiler
# converts 16-bit weights to f32 for its dots (GPU and TPU dot 16-bit inputs directly) and
# loop-invariant code motion hoists those converts out of a scanned layer stack, so every
# layer's f32 copy (4 bytes x all parameters) is alive at once: 24.6 GiB of the 7B stage-2
# peak. Without the pass, one layer's copy at a time, as the accelerator's program holds none.
PLANNING = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
_STATUS: dict[str, str] = {}


def _user_flags() -> dict:
    flags = {}
    for item in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = item.lstrip("-").partition("=")
        flags[name] = value
    return flags


def apply_defaults() -> None:
    """Add DEFAULTS to XLA_FLAGS unless set already, opted out, or too late (backend started)."""
    if os.environ.get("ZEROJAX_DEFAULT_XLA_FLAGS", "1") == "0":
        _STATUS.update({k: "off (ZEROJAX_DEFAULT_XLA_FLAGS=0)" for k in DEFAULTS})
        return
    started = "jax" in sys.modules and bool(
        getattr(sys.modules.get("jax._src.xla_bridge"), "_backends", None)
    )
    user = _user_flags()
    added = []
    for name, value in DEFAULTS.items():
        if name in user:
            _STATUS[name] = f"{user[name]} (set by you)"
        elif started:
            _STATUS[name] = "not set (JAX's backend started before zerojax was imported)"
        else:
            added.append(f"--{name}={value}")
            _STATUS[name] = f"{value} (zerojax default)"
    if added:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *added]).strip()


def apply_planning_flags() -> None:
    """Add PLANNING to XLA_FLAGS (before JAX starts) unless you set those flags yourself."""
    user = _user_flags()
    for name, value in PLANNING.items():
        if name in user:
            _STATUS[name] = f"{user[name]} (set by you)"
        else:
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()
            _STATUS[name] = f"{value} (zerojax plan: no CPU-only f32 weight copies)"


def effective() -> dict:
    """{flag: value and where it came from} for zerojax's default flags."""
    return dict(_STATUS)
