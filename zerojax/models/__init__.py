"""Example models shared by the tests, the demo and the benchmarks; they know nothing of ZeRO."""

from zerojax.models.gpt import GPT, PRESETS, GPTConfig
from zerojax.models.lm import LM, LM_PRESETS, LMConfig

__all__ = ["GPT", "GPTConfig", "PRESETS", "LM", "LMConfig", "LM_PRESETS"]
