"""streamkv: an LLM serving engine built on PagedAttention."""

from streamkv.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import streamkv` must not pull in torch for the pure-Python core.
    if name == "LLM":
        from streamkv.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
