"""The batched sampler: processes and samples one row of logits per sequence on the device.

Processing follows vLLM's order: logit_bias -> min_tokens -> penalties -> temperature -> top_k ->
top_p -> min_p -> sample. `Sampler.processed_probs` is the exact distribution `Sampler.__call__`
draws from, so speculative verification can process draft and target logits the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from ..util import host_to_device
from .params import Logprob, SamplingParams

MAX_CONSTANTS = 256  # per-row parameter vectors a Sampler keeps on the device for reuse


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
            tokens = exponential_race(self.processed_probs(logits, states), states)
        logprobs = None
        if any(s.params.logprobs is not None for s in states):
            logprobs = raw_logprobs(logits.float(), tokens, [s.params.logprobs for s in states])
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
            logits = apply_top_k_top_p(logits, self._constant(top_k, dev) if use_k else None,
                                        self._constant(top_p, dev) if use_p else None)
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        if any(min_p):
            apply_min_p(logits, self._constant(min_p, dev))
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


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Keep p >= min_p * max(p), in logit space (no softmax): x >= max(x) + log(min_p); min_p = 0
    gives a threshold of -inf, which keeps every token."""
    threshold = logits.amax(-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """argmax(p / E), E ~ Exp(1) i.i.d., picks token i with probability p_i. A seeded row draws its
    E from its own generator, so its token depends on nothing else in the batch."""
    noise = torch.empty_like(probs)
    seeded = [i for i, s in enumerate(states) if s.generator is not None and not s.params.is_greedy]
    if len(seeded) < len(states):  # the global RNG fills the rest (drawing only for them would cost a gather)
        fill_exponential(noise)
    for i in seeded:
        fill_exponential(noise[i], states[i].generator)
    # An exact 0 would turn a zero-probability token into 0/0 = NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(-1)


def fill_exponential(t: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Exp(1) draws in place. On the CPU as -log(1 - U): torch's CPU exponential_ takes ~40 ns a
    value (0.3 ms for an 8K vocabulary, 6 ms for 150K), uniform_ and log1p a quarter of that.
    On a GPU exponential_ is one kernel, fewer launches than the composition."""
    if t.is_cuda:
        t.exponential_(generator=generator)
    else:
        t.uniform_(generator=generator).neg_().log1p_().neg_()


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> LogprobsTensors:
    """From the unprocessed model distribution, as vLLM's default logprobs_mode ("raw_logprobs")."""
    logprobs = logits.log_softmax(-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(-1) + 1
    top_lps, top_ids = logprobs.topk(max(n or 0 for n in num_logprobs), dim=-1)
    return LogprobsTensors(sampled, ranks, top_ids, top_lps, list(num_logprobs))
