"""SpeculativeConfig -> a Speculator around the chosen proposer."""
from __future__ import annotations

from ..config import SpeculativeConfig
from ..errors import RequestError
from .speculator import Speculator


def make_speculator(config: SpeculativeConfig | None, target, max_model_len: int, device=None,
                    draft_kv_pool_tokens: int = 0):
    """target: the LoadedModel being served; device: the drafter's (--draft-device; None: the target's);
    draft_kv_pool_tokens: bound each DFlash draft pass's context (spec/draft_pool.py; 0: off).
    Returns None when speculation is off (None or no method)."""
    if config is None or not config.enabled:
        return None
    if draft_kv_pool_tokens and config.method != "dflash":
        raise RequestError(f"draft_kv_pool_tokens bounds a DFlash drafter's context; speculative method "
                           f"{config.method!r} has none to bound")
    if config.method == "ngram":
        proposer, k = _lookup(config), config.draft_tokens()
    elif config.method == "draft_model":
        from .draft_model import DraftModelProposer
        proposer = DraftModelProposer.load(config.model, target, config.draft_dtype, device)
        k = config.draft_tokens()
    else:
        from .dflash import DFlashProposer
        proposer = DFlashProposer.load(config.model, target, device)
        k = config.draft_tokens(proposer.block_size)
        if k > proposer.block_size - 1:
            raise RequestError(f"num_speculative_tokens {k} exceeds the DFlash block ({proposer.block_size} "
                               f"slots: the anchor and {proposer.block_size - 1} drafts)")
        proposer.tree_budget = config.tree_budget
        proposer.enable_pool(draft_kv_pool_tokens)
    lookup = _lookup(config) if config.ngram_first else None
    return Speculator(proposer, k, max_model_len, adaptive=config.adaptive, lookup=lookup)


def _lookup(config: SpeculativeConfig):
    from .ngram import NgramProposer
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
