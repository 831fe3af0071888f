"""speculative_config (vLLM's shape) -> a Speculator around the chosen proposer."""
from __future__ import annotations

from ..errors import RequestError
from .speculator import Speculator

METHODS = ("dflash", "draft_model", "ngram")
KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive",
        "draft_dtype", "ngram_first"}


def make_speculator(config: dict | None, target, max_model_len: int):
    """target: the LoadedModel being served. Returns None when speculation is off."""
    if not config:
        return None
    unknown = set(config) - KEYS
    if unknown:
        raise RequestError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; "
                           f"known: {', '.join(sorted(KEYS))}")
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method not in METHODS:
        raise RequestError(f"speculative method {method!r} does not exist; choose one of {', '.join(METHODS)}")
    k = config.get("num_speculative_tokens")
    if method == "ngram":
        if config.get("ngram_first"):
            raise RequestError("speculative_config['ngram_first'] puts n-gram lookup before a drafter model "
                               "(method dflash or draft_model); method 'ngram' has none")
        proposer = _lookup(config)
        k = 5 if k is None else k
    else:
        if not config.get("model"):
            raise RequestError(f"speculative method {method!r} needs a draft model (speculative_config['model'] "
                               f"or --draft)")
        if method == "draft_model":
            from .draft_model import DraftModelProposer
            proposer = DraftModelProposer.load(config["model"], target, config.get("draft_dtype"))
            k = 4 if k is None else k
        else:
            from .dflash import DFlashProposer
            proposer = DFlashProposer.load(config["model"], target)
            k = proposer.block_size - 1 if k is None else k
            if k > proposer.block_size - 1:
                raise RequestError(f"num_speculative_tokens {k} exceeds the DFlash block ({proposer.block_size} "
                                   f"slots: the anchor and {proposer.block_size - 1} drafts)")
    if not isinstance(k, int) or k < 1:
        raise RequestError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    lookup = _lookup(config) if config.get("ngram_first") else None
    return Speculator(proposer, k, max_model_len, adaptive=bool(config.get("adaptive", True)), lookup=lookup)


def _lookup(config: dict):
    from .ngram import NgramProposer
    return NgramProposer(int(config.get("prompt_lookup_min", 3)), int(config.get("prompt_lookup_max", 5)))
