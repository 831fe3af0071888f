"""Forced acceptance for `lucebox bench speed`: speculation whose drafter proposes the target's own
greedy continuation (recorded by a plain run of the same prompt first), so that every draft is
accepted unless numerics flip a near-tie and tau approaches k + 1.

It isolates what the speculative machinery itself delivers (verify forward, acceptance, commit,
rollback bookkeeping) from drafter quality. The bound it is held to (issue 7):
    speedup <= tau x decode-step / (verify-step + draft-step)
with the step times of the runner's forwards measured in the verify phase and a draft step of
zero (a lookup). Measured speedup / bound >= 0.85 means the engine loses little around the forwards.

In bf16 a verify's rows round differently from a one-token decode, so where two logits nearly tie
(random weights: often) the verifier's argmax can differ from the plain recording's, and from there
on the recording no longer is the speculating engine's own continuation (the random 0.6B shape:
first difference at token 26 of 128, tau 2.5). The drafts are therefore re-recorded from the
speculating engine's own output until it reproduces them (every draft accepted), at most
MAX_RERECORDINGS times; the result says how many it took, how many tokens each run reproduced, and
whether it converged. Each run reproduces a longer prefix, but not at once: where a verify is
narrower (the last steps' drafts are cut short by max_tokens) its rows round differently again
(random qwen3-8b Q4_K_M, 128 tokens: 8 re-recordings reproducing 4, 51, 53, 54, 59, 61, 81, 122
tokens; with at most 4, forced tau stayed 1.77).
"""
from __future__ import annotations

from ..engine.engine import LLMEngine
from ..sampling import SamplingParams
from ..sampling.acceptance import Draft
from ..spec.proposer import Proposer

MAX_RERECORDINGS = 16


class RecordedContinuationProposer(Proposer):
    """Drafts the next tokens of a recorded continuation of the sequence's prompt (benchmarks only)."""
    method = "recorded"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            recorded = self.continuations.get(tuple(seq.prompt_token_ids), [])
            done = len(seq.output_token_ids)
            drafts.append(Draft(list(recorded[done:done + k])))
        return drafts


def forced_phase(loaded, args, engine_args, verify: dict, prompt: list[int], draft_tokens: int) -> dict:
    """Plain greedy decoding of `prompt`, then the same with forced-acceptance drafts of
    `draft_tokens`; medians over args.repeats runs after a warm-up each."""
    from .spec import decode_runs, median_of
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    max_len = len(prompt) + args.decode_tokens + 2 * (draft_tokens + 1)

    def measure(engine: LLMEngine) -> dict:
        decode_runs(engine, [prompt], params)  # warm-up (and, for the plain engine, the recording)
        return median_of([decode_runs(engine, [prompt], params) for _ in range(args.repeats)])

    plain_engine = LLMEngine.from_args(engine_args(args, max_len, loaded), loaded)
    plain_output = greedy_output(plain_engine, prompt, params)
    plain = measure(plain_engine)
    del plain_engine  # the next engine installs its own KV caches in the model
    # An n-gram speculator of the right length, its proposer swapped for the recording: the engine
    # plans its KV, graph buckets and draft length exactly as for any speculator.
    spec = {"method": "ngram", "num_speculative_tokens": draft_tokens, "adaptive": False}
    engine = LLMEngine.from_args(engine_args(args, max_len, loaded, kv_factor=2, speculative_config=spec), loaded)
    forced = forced_decoding(engine, prompt, params, plain_output, args.repeats)
    speedup = forced["tok_s"] / plain["tok_s"]
    bound = forced["tau"] * verify["decode_step_s"] / verify["verify_step_s"]
    return dict(forced, draft_tokens=draft_tokens, plain_tok_s=plain["tok_s"], speedup=speedup, bound=bound,
                of_bound=speedup / bound)


def forced_decoding(engine: LLMEngine, prompt: list[int], params: SamplingParams, plain_output: list[int],
                    repeats: int) -> dict:
    """Greedy decoding of `prompt` by a speculating engine whose proposer drafts the recorded continuation
    (re-recorded from its own output until it reproduces it): tau, acceptance, tok/s (median of `repeats`
    after a warm-up) and how the recording converged."""
    from .spec import decode_runs, median_of
    recorded = {tuple(prompt): plain_output}
    engine.speculator.proposer = RecordedContinuationProposer(recorded)
    rerecorded, reproduced = 0, []  # reproduced: tokens each recording's run reproduced before differing
    key = tuple(prompt)
    while (output := greedy_output(engine, prompt, params)) != recorded[key] and rerecorded < MAX_RERECORDINGS:
        reproduced.append(_equal_before(output, recorded[key]))
        recorded[key], rerecorded = output, rerecorded + 1
    decode_runs(engine, [prompt], params)  # warm-up
    forced = median_of([decode_runs(engine, [prompt], params) for _ in range(repeats)])
    return {"tau": forced["tau"], "acceptance": forced["acceptance"], "tok_s": forced["tok_s"],
            "rerecorded": rerecorded, "reproduced": reproduced, "converged": output == recorded[key],
            "equal_to_plain_before": _equal_before(output, plain_output)}


def _equal_before(a: list[int], b: list[int]) -> int:
    """Tokens a and b share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_output(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("record", {"prompt_token_ids": prompt}, params)
    output = None
    while engine.has_unfinished():
        for out in engine.step():
            output = out.outputs[0].token_ids
    return list(output)
