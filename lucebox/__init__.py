"""lucebox: speculative-inference engine and server for LLMs (PyTorch + Triton)."""
from .errors import LuceboxError
from .outputs import CompletionOutput, RequestOutput
from .sampling import Logprob, SamplingParams


def __getattr__(name):
    # LLM pulls in the model stack; import it on first use so `import lucebox` stays light.
    if name == "LLM":
        from .llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LuceboxError"]
__version__ = "0.1.0"
