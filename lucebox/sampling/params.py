"""SamplingParams (vLLM's names and meaning) and Logprob, the shape outputs carry.

Stop strings live in `lucebox/text/stop.py`; the sampler in `sampler.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from ..errors import RequestError

GREEDY_TEMPERATURE = 1e-5  # below this a temperature means argmax (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # the OpenAI API's limit for top_logprobs
OUTPUT_KINDS = ("cumulative", "final_only")

# HF generation_config.json key -> SamplingParams field it provides a default for.
_GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _record_set_fields(cls):
    """Wrap the dataclass __init__ so each instance knows (`_set_fields`) which fields its caller
    passed: model defaults (`with_defaults`) may only fill the others. dataclasses.replace passes
    every field, so its result counts all of them as set."""
    init = cls.__init__
    names = [f.name for f in fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        self._set_fields = frozenset(names[: len(args)]).union(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_record_set_fields
@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs reported besides the sampled token's
    skip_special_tokens: bool = True
    # Per-request hooks (constrained decoding): each gets the row's generated ids so far and its
    # [vocab] logits, and returns new logits. Applied first, before every other processing step.
    logits_processors: list[Callable[[list[int], torch.Tensor], torch.Tensor]] | None = None
    # What LLMEngine.step reports for the request (vLLM's RequestOutputKind): "cumulative", an output
    # with everything so far after every step that touched it (streaming); "final_only", one output
    # when it finishes (LLM.generate: no per-step copies of a long output).
    output_kind: str = "cumulative"

    def __post_init__(self):
        # Normalised once so the engine never re-checks every shape the API accepts.
        if self.stop is None or isinstance(self.stop, str):
            self.stop = [] if self.stop is None else [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple, type(None))):
            self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def reads_history(self, num_output: int) -> bool:
        """Whether processing the next token's logits depends on the tokens generated before it
        (penalties, logits processors, min_tokens not yet reached after num_output tokens)."""
        return bool(self.logits_processors) or self.has_penalties or self.min_tokens > num_output

    def keeps_argmax(self, num_output: int) -> bool:
        """Whether processing leaves the argmax of the logits where it is: temperature, top-k,
        top-p and min-p never move it; logit_bias, penalties and the like may."""
        return not self.reads_history(num_output) and not self.logit_bias

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """A copy where fields the user did not set take the model's generation_config.json values."""
        user_set = self._set_fields
        updates = {
            name: defaults[key]
            for key, name in _GENERATION_CONFIG_FIELDS.items()
            if defaults.get(key) is not None and name not in user_set
        }
        # HF's do_sample=False decodes greedily whatever temperature the config lists.
        if defaults.get("do_sample") is False and "temperature" not in user_set:
            updates["temperature"] = 0.0
        out = replace(self, **updates)
        out._set_fields = self._set_fields  # still what the user set, not what the model filled
        return out

    def validate(self) -> None:
        _check("n", self.n, lambda v: v >= 1, ">= 1", integer=True)
        _check("temperature", self.temperature, lambda v: v >= 0, ">= 0")
        _check("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check("top_k", self.top_k, lambda v: v >= -1, "an integer >= -1 (0 or -1 disables it)", integer=True)
        _check("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        _check("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            _check(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]")
        if self.max_tokens is not None:
            _check("max_tokens", self.max_tokens, lambda v: v >= 1, "an integer >= 1 or None", integer=True)
        upper = float("inf") if self.max_tokens is None else self.max_tokens
        _check("min_tokens", self.min_tokens, lambda v: 0 <= v <= upper, f"an integer in [0, max_tokens={upper}]",
               integer=True)
        if self.logprobs is not None:
            _check("logprobs", self.logprobs, lambda v: 0 <= v <= MAX_LOGPROBS,
                   f"an integer in [0, {MAX_LOGPROBS}] or None", integer=True)
        if self.seed is not None:
            _check("seed", self.seed, lambda v: -(2**63) <= v < 2**64, "a 64-bit integer or None", integer=True)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", self.logit_bias, "a dict {token_id: bias} or None")
            for tok, bias in self.logit_bias.items():
                _check("logit_bias", tok, lambda v: v >= 0, "keyed by token ids (integers >= 0)", integer=True)
                _check(f"logit_bias[{tok}]", bias, lambda v: -100 <= v <= 100, "in [-100, 100]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "a non-empty string, a list of non-empty strings, or None")
        if not isinstance(self.stop_token_ids, list):
            _fail("stop_token_ids", self.stop_token_ids, "a list of token ids or None")
        for tok in self.stop_token_ids:
            _check("stop_token_ids", tok, lambda v: v >= 0, "a list of token ids (integers >= 0)", integer=True)
        if self.output_kind not in OUTPUT_KINDS:
            _fail("output_kind", self.output_kind, " or ".join(map(repr, OUTPUT_KINDS)))
        if self.logits_processors is not None and (
                not isinstance(self.logits_processors, (list, tuple)) or not all(map(callable, self.logits_processors))):
            _fail("logits_processors", self.logits_processors, "a list of callables (token_ids, logits) -> logits")

    def verify_token_ids(self, vocab_size: int) -> None:
        """Checks what only the model knows: token ids in logit_bias / stop_token_ids exist."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                _fail(name, bad, f"token ids in [0, {vocab_size - 1}] (the model's vocabulary)")


def _fail(name, value, allowed: str):
    raise RequestError(f"sampling parameter {name}={value!r} is invalid: must be {allowed}")


def _check(name, value, ok: Callable, allowed: str, integer: bool = False):
    # bool is an int to Python, but True as a temperature is a client bug, not a number.
    types = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, types) or value != value or not ok(value):
        _fail(name, value, allowed)


@dataclass
class Logprob:
    """One token's log probability in vLLM's shape; outputs carry dict[token_id, Logprob]."""

    logprob: float
    rank: int | None = None  # 1 = most likely under the raw model distribution
    decoded_token: str | None = None
