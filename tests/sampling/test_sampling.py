import math

import pytest
import torch

from lucebox.errors import RequestError
from lucebox.sampling import Logprob, SamplingParams
from lucebox.sampling.sampler import Sampler, SamplingState
from lucebox.text.stop import StopChecker

NEG_INF = float("-inf")


def state(prompt=(), output=(), seed=None, **params):
    sp = SamplingParams(seed=seed, **params)
    st = SamplingState.create(sp, list(prompt))
    st.output_token_ids = list(output)
    return st


def processed(logits, *states, eos=()):
    return Sampler(eos).process_logits(torch.as_tensor(logits, dtype=torch.float32).reshape(len(states), -1),
                                       list(states))


# --- SamplingParams -----------------------------------------------------------------------------

def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.skip_special_tokens


def test_stop_string_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_is_greedy_below_tiny_temperature():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_with_defaults_fills_only_unset_fields():
    p = SamplingParams(temperature=0.3, top_k=5).with_defaults(
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.1})
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.3, 5, 0.8, 0.05, 1.1)


def test_with_defaults_counts_positional_arguments_as_set():
    assert SamplingParams(2, 0.4).with_defaults({"temperature": 0.9}).temperature == 0.4


def test_with_defaults_keeps_explicit_value_equal_to_the_default():
    assert SamplingParams(temperature=1.0).with_defaults({"temperature": 0.6}).temperature == 1.0


def test_do_sample_false_means_greedy_unless_user_set_temperature():
    assert SamplingParams().with_defaults({"do_sample": False, "temperature": 0.6}).is_greedy
    assert SamplingParams(temperature=0.5).with_defaults({"do_sample": False}).temperature == 0.5


def test_with_defaults_ignores_null_and_unknown_keys():
    p = SamplingParams().with_defaults({"top_p": None, "bos_token_id": 1, "do_sample": True})
    assert p == SamplingParams()


def test_with_defaults_does_not_mutate_the_original():
    p = SamplingParams()
    p.with_defaults({"temperature": 0.2})
    assert p.temperature == 1.0


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5),
    ("min_p", 1.1), ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("temperature", "hot"),
    ("stop", ""), ("stop", ["ok", ""]), ("seed", 1.5), ("temperature", True),
])
def test_invalid_value_raises_request_error_naming_the_field(field, value):
    with pytest.raises(RequestError, match=field) as exc:
        SamplingParams(**{field: value})
    assert repr(value) in str(exc.value)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(RequestError, match="min_tokens.*max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=500)


def test_logit_bias_out_of_range_or_non_integer_key_is_rejected():
    with pytest.raises(RequestError, match=r"logit_bias\[3\]"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 1.0})


def test_verify_token_ids_rejects_ids_outside_the_vocabulary():
    with pytest.raises(RequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).verify_token_ids(vocab_size=10)
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1}).verify_token_ids(vocab_size=10)


# --- logit processing against direct references -----------------------------------------------

def test_logit_bias_is_added():
    out = processed([1.0, 2.0, 3.0], state(logit_bias={0: 5.0, 2: -1.5}))
    assert out.tolist() == [[6.0, 2.0, 1.5]]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    early = state(output=[1], min_tokens=2, stop_token_ids=[3])
    done = state(output=[1, 1], min_tokens=2, stop_token_ids=[3])
    out = processed([[0.0] * 5, [0.0] * 5], early, done, eos=[4])
    assert out[0].tolist() == [0, 0, 0, NEG_INF, NEG_INF]
    assert out[1].tolist() == [0.0] * 5


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    out = processed([0.0] * 4, state(min_tokens=1, ignore_eos=True), eos=[3])
    assert out.tolist() == [[0.0] * 4]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    out = processed([2.0, -2.0, 2.0, -2.0], state(prompt=[0], output=[1], repetition_penalty=2.0))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    out = processed([0.0] * 4, state(prompt=[3, 3], output=[0, 0, 0, 1], frequency_penalty=0.5, presence_penalty=0.25))
    assert out.tolist() == [[-1.75, -0.75, 0.0, 0.0]]


def test_temperature_scales_logits():
    assert processed([1.0, 2.0], state(temperature=0.5)).tolist() == [[2.0, 4.0]]


def test_top_k_keeps_k_largest():
    out = processed([0.1, 0.5, 0.3, 0.9, 0.2], state(top_k=2))
    assert torch.isinf(out).tolist() == [[True, False, True, False, True]]


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_is_disabled(top_k):
    assert not torch.isinf(processed([0.1, 0.5, 0.3], state(top_k=top_k))).any()


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]))
    out = processed(logits, state(top_p=0.75))  # 0.4 + 0.3 = 0.7 < 0.75, so 0.15 is needed too
    assert (~torch.isinf(out)).tolist() == [[False, True, False, True, True]]
    assert torch.allclose(out[0, [1, 3, 4]], logits[[1, 3, 4]])


def test_top_p_applies_after_top_k():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    # After top_k=2 the kept mass renormalises to 0.625 / 0.375, so top_p=0.6 keeps only one token.
    assert (~torch.isinf(processed(logits, state(top_k=2, top_p=0.6)))).tolist() == [[True, False, False]]


def test_min_p_drops_tokens_below_fraction_of_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = processed(torch.log(probs), state(min_p=0.2))  # threshold 0.1
    assert (~torch.isinf(out)).tolist() == [[True, True, True, False]]


def test_processing_matches_reference_pipeline_on_random_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 12)
    states = [
        state(prompt=[1, 2], output=[2, 5, 5], temperature=0.7, top_k=6, top_p=0.8, min_p=0.1,
              repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logit_bias={7: 2.0}),
        state(temperature=1.3),
        state(prompt=[4], output=[4], repetition_penalty=0.8, top_p=0.5),
    ]
    out = Sampler().process_logits(logits, states)

    def reference(row, st):
        p, x = st.params, row.clone()
        for tok, b in (p.logit_bias or {}).items():
            x[tok] += b
        for tok in set(st.prompt_token_ids) | set(st.output_token_ids):
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        for tok in set(st.output_token_ids):
            x[tok] -= p.frequency_penalty * st.output_token_ids.count(tok) + p.presence_penalty
        x = x / p.temperature
        if p.top_k > 0:
            x[x < x.sort(descending=True).values[p.top_k - 1]] = NEG_INF
        order = x.argsort(descending=True)
        mass = 0.0
        probs = x.softmax(-1)
        for tok in order.tolist():
            if mass >= p.top_p:
                x[tok] = NEG_INF
            mass += probs[tok].item()
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = NEG_INF
        return x

    for i, st in enumerate(states):
        assert torch.allclose(out[i], reference(logits[i], st), atol=1e-5), i


def test_process_logits_does_not_modify_input():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    Sampler().process_logits(logits, [state(logit_bias={0: 1.0}, temperature=0.5)])
    assert logits.tolist() == [[1.0, 2.0, 3.0]]


# --- sampling --------------------------------------------------------------------------------------

def test_greedy_is_argmax_of_processed_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 4.0, 0.0]])
    states = [state(temperature=0), state(temperature=0, prompt=[0], repetition_penalty=2.0)]
    assert Sampler()(logits, states).sampled_token_ids.tolist() == [1, 1]


def test_greedy_processed_probs_are_one_hot():
    probs = Sampler().processed_probs(torch.tensor([[0.0, 3.0, 1.0]]), [state(temperature=0)])
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_processed_probs_sum_to_one_and_respect_masks():
    probs = Sampler().processed_probs(torch.randn(2, 8), [state(top_k=3), state(min_p=0.3)])
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    assert (probs[0] > 0).sum() == 3


def test_same_seed_same_tokens_regardless_of_batch_composition():
    torch.manual_seed(1)
    logits = torch.randn(1, 50)

    def run(batch_before, batch_after):
        seeded = state(seed=1234)
        others_before = [state() for _ in range(batch_before)]
        others_after = [state(seed=7) for _ in range(batch_after)]
        sampler, tokens = Sampler(), []
        for _ in range(20):
            states = others_before + [seeded] + others_after
            rows = torch.cat([torch.randn(batch_before, 50), logits, torch.randn(batch_after, 50)])
            tokens.append(sampler(rows, states).sampled_token_ids[batch_before].item())
        return tokens

    assert run(0, 0) == run(3, 2) == run(1, 0)
    assert len(set(run(0, 0))) > 1  # it really samples


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, 1000)
    draw = lambda seed: Sampler()(logits, [state(seed=seed)]).sampled_token_ids.item()  # noqa: E731
    assert len({draw(s) for s in range(5)}) > 1


def test_seeded_siblings_of_one_request_differ():
    params = SamplingParams(seed=3, n=2)
    a, b = (SamplingState.create(params, [], index=i) for i in range(2))
    logits = torch.zeros(2, 1000)
    tokens = Sampler()(logits, [a, b]).sampled_token_ids
    assert tokens[0] != tokens[1]


def test_empirical_distribution_matches_processed_probs():
    torch.manual_seed(0)
    n = 20_000
    row = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.7]])
    st = state(seed=42, temperature=0.8, top_k=4, repetition_penalty=1.2, prompt=[3])
    sampler = Sampler()
    expected = sampler.processed_probs(row, [st])[0]
    # A batch of n copies sharing one generator: n draws from the same distribution.
    batch = row.expand(n, -1)
    tokens = sampler(batch, [st] * n).sampled_token_ids
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    exp_counts = expected[kept].double() * n
    chi2 = (((counts[kept] - exp_counts) ** 2) / exp_counts).sum().item()
    assert chi2 < 20.0  # 3 degrees of freedom: p ~ 2e-4


def test_unseeded_rows_also_follow_processed_probs():
    torch.manual_seed(5)
    n = 20_000
    row = torch.tensor([[0.0, 1.0, 2.0]])
    st = state(min_p=0.2)
    expected = Sampler().processed_probs(row, [st])[0].double()
    counts = torch.bincount(Sampler()(row.expand(n, -1), [st] * n).sampled_token_ids, minlength=3).double()
    kept = expected > 0
    chi2 = (((counts[kept] - expected[kept] * n) ** 2) / (expected[kept] * n)).sum().item()
    assert counts[~kept].sum() == 0 and chi2 < 20.0


# --- logprobs --------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_and_include_the_sampled_token():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0]])
    # Processing forces token 0, which is not among the raw top 2.
    out = Sampler()(logits, [state(temperature=0, logit_bias={0: 100.0}, logprobs=2)])
    raw = torch.log_softmax(logits[0], -1)
    [d] = out.logprob_dicts()
    assert out.sampled_token_ids.tolist() == [0]
    assert set(d) == {0, 3, 2}
    for tok, lp in d.items():
        assert math.isclose(lp.logprob, raw[tok].item(), rel_tol=1e-6)
    assert (d[0].rank, d[3].rank, d[2].rank) == (4, 1, 2)


def test_logprobs_zero_reports_only_the_sampled_token_and_none_when_unrequested():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    dicts = Sampler()(logits, [state(temperature=0, logprobs=0), state(temperature=0)]).logprob_dicts(
        decode=lambda t: f"<{t}>")
    assert dicts[1] is None
    assert dicts[0] == {2: Logprob(torch.log_softmax(logits[0], -1)[2].item(), 1, "<2>")}


# --- stop strings ---------------------------------------------------------------------------------

def feed_all(checker, pieces):
    emitted, result = "", (None, False, None)
    for piece in pieces:
        result = checker.feed(piece)
        emitted += result[0]
        if result[1]:
            break
    return emitted, result[1], result[2]


def test_stop_string_split_over_three_pieces_is_detected_and_never_emitted():
    checker = StopChecker(["<END>"])
    assert checker.feed("hello <") == ("hello ", False, None)
    assert checker.feed("EN") == ("", False, None)
    assert checker.feed("D> tail") == ("", True, "<END>")


def test_include_stop_str_in_output_keeps_the_stop_string():
    assert feed_all(StopChecker(["<END>"], include_stop_str_in_output=True), ["a <", "EN", "D> b"]) == (
        "a <END>", True, "<END>")


def test_held_back_text_is_released_when_it_stops_looking_like_a_stop_string():
    checker = StopChecker(["<END>"])
    assert checker.feed("x <EN") == ("x ", False, None)
    assert checker.feed("X") == ("<ENX", False, None)


def test_overlapping_candidates_find_the_stop_string():
    # "aab" inside "aaab": the first 'a' has to be released once the match shifts by one.
    assert feed_all(StopChecker(["aab"]), ["a", "a", "a", "b", "c"]) == ("a", True, "aab")


def test_first_completed_stop_string_wins_independent_of_piece_boundaries():
    for pieces in (["xabcd"], ["x", "a", "b", "c", "d"], ["xab", "cd"]):
        assert feed_all(StopChecker(["abcd", "bc"]), pieces) == ("xa", True, "bc")


def test_flush_returns_held_text_when_sequence_ends_without_match():
    checker = StopChecker(["###", "<|im_end|>"])
    emitted, stopped, _ = feed_all(checker, ["done", " <|im"])
    assert (emitted, stopped) == ("done ", False)
    assert checker.flush() == "<|im"
    assert checker.flush() == ""


def test_no_stop_strings_passes_text_through():
    assert StopChecker([]).feed("anything") == ("anything", False, None)


def test_feed_after_stop_emits_nothing():
    checker = StopChecker.from_params(SamplingParams(stop="!"))
    assert checker.feed("hi!") == ("hi", True, "!")
    assert checker.feed("more") == ("", True, "!")


def test_stop_checker_agrees_with_whole_text_search_for_any_split():
    import random

    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        for include in (False, True):
            checker = StopChecker(stops, include_stop_str_in_output=include)
            emitted, stopped, matched = feed_all(checker, pieces)
            if ends:
                end, start, stop = min(ends)
                assert (emitted, stopped, matched) == (text[:end if include else start], True, stop), (stops, pieces)
            else:
                assert (emitted + checker.flush(), stopped) == (text, False), (stops, pieces)


def test_with_defaults_takes_max_new_tokens_as_max_tokens():
    assert SamplingParams().with_defaults({"max_new_tokens": 256}).max_tokens == 256
    assert SamplingParams(max_tokens=8).with_defaults({"max_new_tokens": 256}).max_tokens == 8
