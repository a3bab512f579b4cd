"""Example models shared by the tests, the demo and the benchmarks; they know nothing of ZeRO."""
from zerojax.models.gpt import GPT, GPTConfig, PRESETS
from zerojax.models.lm import LM, LMConfig, LM_PRESETS

__all__ = ["GPT", "GPTConfig", "PRESETS", "LM", "LMConfig", "LM_PRESETS"]
