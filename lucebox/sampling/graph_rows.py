"""What a CUDA-graph step may do with a sequence's next token, decided from its SamplingParams.

The step planner (engine/step_plan.py) asks these per sequence: whether the graph's argmax
tokens are the answer (no logits come back), whether the graph may sample and accept in place
(`sampling.acceptance.accept_in_graph`), and the parameters such a graph reads.
"""
from __future__ import annotations

from .params import SamplingParams

GraphRow = tuple[float, int, float, float, bool]  # temperature, top_k, top_p, min_p, greedy


def argmax_only(params: SamplingParams, num_output: int) -> bool:
    """Whether the next token (and, speculating, every draft position after it) is the plain
    argmax of the model's logits: greedy, nothing processing the logits, no logprobs wanted.
    The engine then takes argmax tokens computed inside the CUDA graph, not the logits."""
    return params.is_greedy and params.keeps_argmax(num_output) and params.logprobs is None


def graph_samplable(params: SamplingParams, num_output: int) -> bool:
    """Whether the next token (a decode) or the verdict on drafts (a verify) can be drawn inside
    a CUDA graph: argmax-only, or sampled with temperature / top-k / top-p / min-p alone from the
    global RNG (a seeded request keeps its own generator, so it samples outside)."""
    return (params.is_greedy or params.seed is None) and params.keeps_argmax(num_output) and params.logprobs is None


def graph_row(params: SamplingParams, vocab: int) -> GraphRow:
    """(temperature, top_k, top_p, min_p, greedy) as `accept_in_graph` reads them: filters that
    are off take values that keep every token (top_k = vocab, top_p = 2)."""
    if params.is_greedy:
        return 1.0, vocab, 2.0, 0.0, True
    return (params.temperature, params.top_k if 0 < params.top_k < vocab else vocab,
            params.top_p if params.top_p < 1 else 2.0, params.min_p, False)
