"""ssd: exact LLM inference with autoregressive, speculative and speculative-speculative decoding."""
from ssd.config import EngineConfig
from ssd.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name):  # keep `import ssd` light: torch/transformers load on first use
    if name == "LLM":
        from ssd.llm import LLM
        return LLM
    if name == "RequestOutput":
        from ssd.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(name)
