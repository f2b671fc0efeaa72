"""The LLM generation runtime: static-shape prefill/decode programs, a CPU-owned KV cache, CPU sampling.

``Engine(load_model(name)).generate(prompt, SamplingParams(...))`` is the one way in; ``hetforge run``
is the CLI over it. See docs/arch/runtime.md.
"""

from hetforge.runtime.engine import Engine, Generation, GenerationResult
from hetforge.runtime.executors import EXECUTORS, make_executor
from hetforge.runtime.kvcache import KVCache
from hetforge.runtime.programs import ProgramCache, pick_tier, tiers_for
from hetforge.runtime.sampling import Sampler, SamplingParams

__all__ = [
    "EXECUTORS",
    "Engine",
    "Generation",
    "GenerationResult",
    "KVCache",
    "ProgramCache",
    "Sampler",
    "SamplingParams",
    "make_executor",
    "pick_tier",
    "tiers_for",
]
