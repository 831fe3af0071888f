"""SamplingParams (vLLM's names and meaning) and the batched sampler.

Processing follows vLLM's order: logit_bias -> min_tokens -> penalties -> temperature -> top_k ->
top_p -> min_p -> sample. `Sampler.processed_probs` is the exact distribution `Sampler.__call__`
draws from, so speculative verification can process draft and target logits the same way.
Stop strings live in `lucebox/stop.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterable, Sequence

import torch

from lucebox.errors import RequestError
from lucebox.util import host_to_device

GREEDY_TEMPERATURE = 1e-5  # below this a temperature means argmax (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # the OpenAI API's limit for top_logprobs
MAX_CONSTANTS = 256  # per-row parameter vectors a Sampler keeps on the device for reuse
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

    def argmax_only(self, num_output: int) -> bool:
        """Whether the next token (and, speculating, every draft position after it) is the plain
        argmax of the model's logits: greedy, nothing processing the logits, no logprobs wanted.
        The engine then takes argmax tokens computed inside the CUDA graph, not the logits."""
        return self.is_greedy and self.keeps_argmax(num_output) and self.logprobs is None

    def keeps_argmax(self, num_output: int) -> bool:
        """Whether processing leaves the argmax of the logits where it is: temperature, top-k,
        top-p and min-p never move it; logit_bias, penalties and the like may."""
        return not self.reads_history(num_output) and not self.logit_bias

    def graph_samplable(self, num_output: int) -> bool:
        """Whether the next token (a decode) or the verdict on drafts (a verify) can be drawn inside
        a CUDA graph (`spec.verify.accept_in_graph`): argmax-only, or sampled with temperature /
        top-k / top-p / min-p alone from the global RNG (a seeded request keeps its own generator,
        so it samples outside)."""
        return (self.is_greedy or self.seed is None) and self.keeps_argmax(num_output) and self.logprobs is None

    def graph_row(self, vocab: int) -> tuple[float, int, float, float, bool]:
        """(temperature, top_k, top_p, min_p, greedy) as `accept_in_graph` reads them: filters that
        are off take values that keep every token (top_k = vocab, top_p = 2)."""
        if self.is_greedy:
            return 1.0, vocab, 2.0, 0.0, True
        return (self.temperature, self.top_k if 0 < self.top_k < vocab else vocab,
                self.top_p if self.top_p < 1 else 2.0, self.min_p, False)

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


@dataclass
class SamplingState:
    """What the sampler reads per row. The engine's Sequence may stand in for it (same attributes).

    For a speculative verify, give each row of a sequence its own state whose output_token_ids
    include the drafts before that row, so penalties and min_tokens see the right history.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # on the logits' device; None: global RNG

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Sequence[int],
               device: torch.device | str = "cpu", index: int = 0) -> SamplingState:
        """`index` is the sample's number among a request's n, so seeded siblings differ."""
        return cls(params, prompt_token_ids, [], make_generator(params.seed, device, index))


def make_generator(seed: int | None, device: torch.device | str = "cpu", index: int = 0) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed((seed + index) % 2**64)
    return gen


@dataclass
class LogprobsTensors:
    """Logprobs for a batch, left on the device until `SamplerOutput.logprob_dicts`."""

    sampled_logprobs: torch.Tensor  # [num_seqs]
    sampled_ranks: torch.Tensor  # [num_seqs]
    top_token_ids: torch.Tensor  # [num_seqs, max requested]
    top_logprobs: torch.Tensor  # [num_seqs, max requested]
    num_logprobs: list[int | None]  # per row; None = not requested


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_seqs] int64
    logprobs: LogprobsTensors | None = None

    def logprob_dicts(self, decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob] | None]:
        """Per row: {sampled token, top-N tokens} -> Logprob, or None where not requested."""
        lp = self.logprobs
        if lp is None:
            return [None] * len(self.sampled_token_ids)
        tokens, sampled, ranks = (t.tolist() for t in (self.sampled_token_ids, lp.sampled_logprobs, lp.sampled_ranks))
        top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
        text = decode or (lambda _: None)
        out: list[dict[int, Logprob] | None] = []
        for i, n in enumerate(lp.num_logprobs):
            if n is None:
                out.append(None)
                continue
            d = {tokens[i]: Logprob(sampled[i], ranks[i], text(tokens[i]))}
            for r in range(n):
                d.setdefault(top_ids[i][r], Logprob(top_lps[i][r], r + 1, text(top_ids[i][r])))
            out.append(d)
        return out


class Sampler:
    """Processes and samples one row of logits per state; stays on the logits' device."""

    def __init__(self, eos_token_ids: Iterable[int] = ()):
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._constants: dict[tuple, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        if all(s.params.is_greedy for s in states):  # no softmax, no randomness spent
            tokens = self.process_logits(logits, states).argmax(-1)
        else:
            tokens = _exponential_race(self.processed_probs(logits, states), states)
        logprobs = None
        if any(s.params.logprobs is not None for s in states):
            logprobs = _raw_logprobs(logits.float(), tokens, [s.params.logprobs for s in states])
        return SamplerOutput(tokens, logprobs)

    def processed_probs(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """[num_seqs, vocab] distribution sampled from; greedy rows are one-hot at the argmax."""
        logits = self.process_logits(logits, states)
        probs = logits.softmax(-1)
        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        if greedy:
            rows = host_to_device(greedy, logits.device)
            # scatter, not F.one_hot: one_hot checks its input's range on the host (a device sync)
            one_hot = probs.new_zeros(len(greedy), probs.shape[1])
            probs[rows] = one_hot.scatter_(1, logits[rows].argmax(-1, keepdim=True), 1.0)
        return probs

    def process_logits(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """A processed float32 copy of `logits`; filtered-out tokens are -inf."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling states")
        logits = logits.to(torch.float32, copy=True)
        params = [s.params for s in states]
        _apply_logits_processors(logits, states)
        _apply_logit_bias(logits, params)
        _apply_min_tokens(logits, states, self.eos_token_ids)
        _apply_penalties(logits, states)
        sampled = [not p.is_greedy for p in params]  # filters cannot change a greedy row's argmax
        dev, vocab = logits.device, logits.shape[1]
        if any(sampled):
            temps = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
            if len(set(temps)) > 1:
                logits.div_(self._constant(temps, dev).unsqueeze(1))
            elif temps[0] != 1.0:
                logits.div_(temps[0])
        top_k = [p.top_k if s and 0 < p.top_k < vocab else vocab for p, s in zip(params, sampled)]
        top_p = [p.top_p if s and p.top_p < 1 else 2.0 for p, s in zip(params, sampled)]  # 2.0: never reached
        use_k, use_p = any(k < vocab for k in top_k), any(p < 1 for p in top_p)
        if use_k or use_p:
            logits = _apply_top_k_top_p(logits, self._constant(top_k, dev) if use_k else None,
                                        self._constant(top_p, dev) if use_p else None)
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        if any(min_p):
            _apply_min_p(logits, self._constant(min_p, dev))
        return logits

    def _constant(self, values: list, device) -> torch.Tensor:
        """A per-row parameter vector on the device, kept for reuse: a batch whose rows keep their
        parameters step after step (the usual case) costs no host-to-device copy (each one a few
        CUDA calls, and sampling at small batch is bound by their count, not by the GPU)."""
        key = (tuple(values), str(device))
        tensor = self._constants.get(key)
        if tensor is None:
            if len(self._constants) >= MAX_CONSTANTS:
                self._constants.clear()
            tensor = self._constants[key] = host_to_device(values, device)
        return tensor


def _apply_logits_processors(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    # Each row with its own history: under speculative verification a sequence's rows differ.
    for i, s in enumerate(states):
        for proc in s.params.logits_processors or ():
            logits[i] = proc(list(s.output_token_ids), logits[i])


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for tok, bias in (p.logit_bias or {}).items():
            rows.append(i), cols.append(tok), vals.append(float(bias))
    if rows:
        idx = (host_to_device(rows, logits.device), host_to_device(cols, logits.device))
        logits.index_put_(idx, host_to_device(vals, logits.device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState], eos_token_ids: list[int]) -> None:
    rows, cols = [], []
    for i, s in enumerate(states):
        p = s.params
        if len(s.output_token_ids) < p.min_tokens:
            # With ignore_eos, EOS does not end the sequence, so (as in vLLM) it need not be masked.
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            rows += [i] * len(ids)
            cols += sorted(ids)
    if rows:
        logits[host_to_device(rows, logits.device), host_to_device(cols, logits.device)] = float("-inf")


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts; scatter_add (not bincount) avoids a device sync."""
    lengths = torch.tensor([len(t) for t in token_lists])
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long)
    flat = host_to_device(rows * vocab + ids, device)
    counts = torch.zeros(len(token_lists) * vocab, device=device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype)).view(len(token_lists), vocab)


def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]

    def col(name: str) -> torch.Tensor:
        return host_to_device([float(getattr(states[i].params, name)) for i in rows], dev).unsqueeze(1)

    out_counts = _token_counts([states[i].output_token_ids for i in rows], vocab, dev)
    in_prompt = _token_counts([states[i].prompt_token_ids for i in rows], vocab, dev) > 0
    idx = host_to_device(rows, dev)
    sub = logits[idx]
    # HF/vLLM repetition penalty: over prompt + output, always pushing the logit towards "less likely".
    penalty = torch.where(in_prompt | (out_counts > 0), col("repetition_penalty"), 1.0)
    sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    # OpenAI frequency / presence penalties: over generated tokens only.
    sub -= col("frequency_penalty") * out_counts
    sub -= col("presence_penalty") * (out_counts > 0)
    logits[idx] = sub


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k: [num_seqs] (vocab = off) or None (off for all); top_p: [num_seqs] (> 1 = off) or None.
    Ties with the k-th logit are kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        # Keep the smallest prefix whose mass reaches top_p: a token goes once the ones above it reach it.
        sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Keep p >= min_p * max(p), in logit space (no softmax): x >= max(x) + log(min_p); min_p = 0
    gives a threshold of -inf, which keeps every token."""
    threshold = logits.amax(-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def _exponential_race(probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1) i.i.d., picks token i with probability p_i. A seeded row draws its
    E from its own generator, so its token depends on nothing else in the batch."""
    noise = torch.empty_like(probs)
    seeded = [i for i, s in enumerate(states) if s.generator is not None and not s.params.is_greedy]
    if len(seeded) < len(states):  # the global RNG fills the rest (drawing only for them would cost a gather)
        _fill_exponential(noise)
    for i in seeded:
        _fill_exponential(noise[i], states[i].generator)
    # An exact 0 would turn a zero-probability token into 0/0 = NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(-1)


def _fill_exponential(t: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Exp(1) draws in place. On the CPU as -log(1 - U): torch's CPU exponential_ takes ~40 ns a
    value (0.3 ms for an 8K vocabulary, 6 ms for 150K), uniform_ and log1p a quarter of that.
    On a GPU exponential_ is one kernel, fewer launches than the composition."""
    if t.is_cuda:
        t.exponential_(generator=generator)
    else:
        t.uniform_(generator=generator).neg_().log1p_().neg_()


def _raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> LogprobsTensors:
    """From the unprocessed model distribution, as vLLM's default logprobs_mode ("raw_logprobs")."""
    logprobs = logits.log_softmax(-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(-1) + 1
    top_lps, top_ids = logprobs.topk(max(n or 0 for n in num_logprobs), dim=-1)
    return LogprobsTensors(sampled, ranks, top_ids, top_lps, list(num_logprobs))
