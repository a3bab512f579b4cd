"""Example models shared by the tests, the demo and the benchmarks; they know nothing of ZeRO."""
from zerojax.models.gpt import GPT, GPTConfig, PRESETS

__all__ = ["GPT", "GPTConfig", "PRESETS"]
