"""Flax integration: module transforms zerojax understands."""

from zerojax.flax.units import gather_on_use

__all__ = ["gather_on_use"]
