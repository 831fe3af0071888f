"""Prefix caching on hybrids (Gated DeltaNet + full attention): a cached prefix is reused only up to a
block boundary whose recurrent state a snapshot keeps (engine/state_snapshots.py), and what follows
is exactly what a cold run computes -- shared prompts, multi-turn conversations, n-gram speculation,
the CUDA-graph batch path with steps launched ahead, snapshot eviction and preemption."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.config import EngineArgs
from lucebox.errors import RequestError
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import BLOCK_SIZE, HYBRID, prompts
from tests.spec_fixtures import write_dflash_drafter

NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("hybrid_prefix"), tokenizer_dir, **HYBRID)


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), **({"block_size": BLOCK_SIZE, "max_num_seqs": 4, "max_num_batched_tokens": 64} | kwargs))


@pytest.fixture(scope="module")
def cold(hybrid_path) -> LLM:
    """The reference: every request computed from the start."""
    return engine(hybrid_path, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def vocab(cold) -> int:
    return cold.engine.loaded.config.vocab_size


def greedy(llm: LLM, prompt: list[int], max_tokens: int = 10, logprobs: int | None = 3):
    # Logprobs too: a tiny random model's argmax could survive a wrong recurrent state; they could not.
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def assert_same(got, want, tol: float = 1e-4) -> None:
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for mine, theirs in zip(got.outputs[0].logprobs or (), want.outputs[0].logprobs or ()):
        assert mine.keys() == theirs.keys()
        for token, lp in mine.items():
            assert lp.logprob == pytest.approx(theirs[token].logprob, abs=tol)


def test_a_repeated_prompt_is_served_up_to_its_snapshot_and_computes_the_same(hybrid_path, cold, vocab):
    (prompt,) = prompts(vocab, [37], seed=21)
    llm = engine(hybrid_path)
    cache = llm.engine.scheduler.cache
    first = greedy(llm, prompt)
    assert first.num_cached_tokens == 0
    assert_same(first, greedy(cold, prompt))
    again = greedy(llm, prompt)
    assert again.num_cached_tokens == 36  # the last boundary before the token that must be computed
    assert cache.snapshots.loaded == 1
    assert_same(again, greedy(cold, prompt))
    longer = prompt + prompts(vocab, [9], seed=22)[0]  # the prompt and other text than the first output
    out = greedy(llm, longer)
    assert out.num_cached_tokens == 36
    assert_same(out, greedy(cold, longer))


def test_a_shared_system_prompt_is_reused_from_the_third_conversation_on(hybrid_path, cold, vocab):
    """The second conversation finds the first's blocks of the shared part but no state at its end:
    it computes from the start, ending a chunk where it leaves those blocks to keep the state there."""
    system, *users = prompts(vocab, [30, 10, 9, 11], seed=29)
    llm = engine(hybrid_path)
    outs = [greedy(llm, system + user, 4) for user in users]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 28]  # 28: the last boundary inside the system prompt
    for out, user in zip(outs, users):
        assert_same(out, greedy(cold, system + user, 4))


def test_the_prefill_chunk_ends_at_the_prompt_snapshot_boundary(hybrid_path, vocab):
    (prompt,) = prompts(vocab, [23], seed=23)
    llm = engine(hybrid_path)
    llm.engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2))
    llm.engine.step()
    (seq,) = llm.engine.scheduler.running
    assert seq.num_computed == 20  # not 23: the state at 20 is kept, then 20..22 in the next step
    cache = llm.engine.scheduler.cache
    assert seq.block_hashes[4] in cache.snapshots
    llm.engine.step()
    assert seq.num_computed == 23 and len(seq.output_token_ids) == 1

    off = engine(hybrid_path, recurrent_prefix_snapshots=0)  # no snapshots: one chunk, no prefix reuse
    assert not off.engine.scheduler.cache.blocks.enable_prefix_caching
    off.engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2))
    off.engine.step()
    assert off.engine.scheduler.running[0].num_computed == 23
    assert greedy(off, prompt).num_cached_tokens == 0


@pytest.mark.parametrize("graphs", [False, True])
def test_a_second_turn_reuses_the_first_turns_prompt_and_output(graphs, hybrid_path, cold, vocab):
    """graphs: the CUDA-graph batch path (uncaptured on CPU), where greedy decode steps without
    logprobs are launched ahead and their recurrent updates applied once used: turn 1's snapshots
    are taken between such steps."""
    turn1, new = prompts(vocab, [30, 10], seed=24)
    llm = engine(hybrid_path, cuda_graphs=graphs)
    if graphs:
        llm.engine.runner.attach_graphs(replace(llm.engine._graph_settings(), capture=False))
    first = greedy(llm, turn1, 20, logprobs=None if graphs else 3)
    assert_same(first, greedy(cold, turn1, 20))
    if graphs:
        assert llm.engine.step_counts["overlapped"] > 5
    turn2 = turn1 + list(first.outputs[0].token_ids) + new
    second = greedy(llm, turn2, 12)
    # 49 positions computed by turn 1 (its last token never was): its last boundary is 48
    assert second.num_cached_tokens == 48
    assert_same(second, greedy(cold, turn2, 12))


def test_ngram_speculation_with_prefix_hits_stays_token_identical(hybrid_path, cold, vocab):
    a, b, c = prompts(vocab, [5, 3, 7], seed=11)
    turn1 = a * 4 + b * 3 + c  # repeated phrases: the n-gram lookup drafts from them
    spec = engine(hybrid_path, speculative_config=NGRAM)
    first = greedy(spec, turn1, 24)
    assert_same(first, greedy(cold, turn1, 24))
    turn2 = turn1 + list(first.outputs[0].token_ids) + b + a * 2
    second = greedy(spec, turn2, 24)
    assert_same(second, greedy(cold, turn2, 24))
    again = greedy(spec, turn1, 24)
    assert_same(again, first)
    # turn 1's last boundary, though its verifies jump past boundaries (their commits stop there)
    assert second.num_cached_tokens == (len(turn1) + 24 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.num_cached_tokens == 32
    assert spec.engine.step_counts["verify"] > 0 and sum(o.metrics.num_accepted_tokens for o in (first, second)) > 0


def test_dflash_speculation_with_prefix_hits_stays_token_identical(hybrid_path, cold, vocab, tmp_path):
    """A DFlash drafter's context K/V of cached positions come with the shared blocks; the target's
    recurrent state from the snapshot: turn 2 equals a cold plain run."""
    drafter = write_dflash_drafter(hybrid_path, tmp_path / "d", taps=(0, 2), block_size=4)
    config = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False}
    turn1, new = prompts(vocab, [26, 6], seed=28)
    spec = engine(hybrid_path, speculative_config=config)
    first = greedy(spec, turn1, 20)
    assert_same(first, greedy(cold, turn1, 20))
    turn2 = turn1 + list(first.outputs[0].token_ids) + new
    second = greedy(spec, turn2, 20)
    assert second.num_cached_tokens == (len(turn1) + 20 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert_same(second, greedy(cold, turn2, 20))
    assert spec.engine.step_counts["verify"] > 0


def test_a_commit_split_at_a_boundary_equals_one_commit():
    from lucebox.model.cache_spec import RecurrentSpec
    spec = RecurrentSpec((4, 8, 12), (2 * 2 * 8 + 4 * 12, 3), 2, torch.float32)
    whole, split = spec.build(3, 5, "cpu", layers=2), spec.build(3, 5, "cpu", layers=2)
    g = torch.Generator().manual_seed(5)
    for name in ("state", "conv", "stash_raw", "stash_mixed", "stash_g", "stash_beta"):
        value = torch.randn(getattr(whole, name).shape, generator=g)
        value = -value.abs() if name == "stash_g" else value.sigmoid() if name == "stash_beta" else value
        getattr(whole, name).copy_(value)
        getattr(split, name).copy_(value)
    slots, accepted = torch.tensor([1, 2]), torch.tensor([3, 2])
    whole.commit(slots, accepted)
    split.commit(torch.tensor([1]), torch.tensor([1]))  # slot 1: its first 2 of 4 tokens
    split.commit(slots, accepted, skip=torch.tensor([2, 0]))
    assert torch.equal(whole.state, split.state) and torch.equal(whole.conv, split.conv)


def test_an_evicted_snapshot_falls_back_to_a_shorter_hit_or_to_recompute(hybrid_path, cold, vocab):
    prompt, other = prompts(vocab, [37, 9], seed=25)
    one = engine(hybrid_path, recurrent_prefix_snapshots=1)
    out = greedy(one, prompt)  # snapshot at 36, then its moving one at 40, 44 takes the only entry
    again = greedy(one, prompt)  # blocks cached up to 36, their state gone: computed from the start
    assert again.num_cached_tokens == 0
    assert_same(again, out)

    two = engine(hybrid_path, recurrent_prefix_snapshots=2)
    out = greedy(two, prompt)  # snapshots at 36 (prompt) and 44 (moving)
    assert greedy(two, prompt, 1).num_cached_tokens == 36  # touches 36: 44 is now least recent
    greedy(two, other, 2)  # its prompt snapshot (8) evicts 44
    turn2 = prompt + list(out.outputs[0].token_ids) + other
    second = greedy(two, turn2)
    assert second.num_cached_tokens == 36  # blocks cached to 44, the deepest state kept is 36's
    assert_same(second, greedy(cold, turn2))
    assert two.engine.scheduler.cache.snapshots.evicted > 0


def test_preempted_sequences_with_shared_prefixes_resume_identical(hybrid_path, cold, vocab):
    """A pool too small for three sequences sharing a prefix: the newest is preempted and, when
    readmitted, served from the prefix cache where a snapshot allows."""
    shared, *tails = prompts(vocab, [13, 3, 5, 2], seed=26)
    batch = [shared + tail for tail in tails]
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True, logprobs=3)
    requests = [{"prompt_token_ids": p} for p in batch]
    want = cold.generate(requests, params, use_tqdm=False)
    probe = engine(hybrid_path, max_model_len=48, max_num_seqs=3, max_num_batched_tokens=32).engine.scheduler.cache
    tight = engine(hybrid_path, max_model_len=48, max_num_seqs=3, max_num_batched_tokens=32,
                   kv_cache_memory=probe.bytes_per_sequence * 3 + probe.snapshot_bytes
                   + probe.bytes_per_token * BLOCK_SIZE * 15)
    assert tight.engine.runner.num_blocks == 15
    greedy(tight, shared, 1)  # the shared prompt's snapshot (at 12) and blocks are cached
    outs = tight.generate(requests, params, use_tqdm=False)
    for got, ref in zip(outs, want):
        assert_same(got, ref)
    cache = tight.engine.scheduler.cache
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outs] == [12] * len(batch)
    assert cache.snapshots.loaded > len(batch)  # a readmission after preemption resumed from a snapshot too
    assert not cache.slots and len(cache.free_slots) == 3


def test_the_snapshot_pool_is_counted_in_the_memory_plan(hybrid_path):
    memory = 1 << 20
    none = engine(hybrid_path, kv_cache_memory=memory, recurrent_prefix_snapshots=0).engine
    many = engine(hybrid_path, kv_cache_memory=memory, recurrent_prefix_snapshots=5).engine
    cache = many.scheduler.cache
    per_slot = sum(s.state[0].numel() * 4 + s.conv[0].numel() * 4 for s in cache.states)
    assert cache.snapshot_bytes == 5 * per_slot
    assert sum(t.numel() * t.element_size() for pair in cache.snapshots.storage for t in pair) == 5 * per_slot
    per_block = cache.bytes_per_token * BLOCK_SIZE
    assert none.runner.num_blocks - many.runner.num_blocks == pytest.approx(5 * per_slot / per_block, abs=1)
    with pytest.raises(RequestError, match="recurrent_prefix_snapshots"):
        EngineArgs(recurrent_prefix_snapshots=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_prefix_hits_under_cuda_graphs_on_a_gpu(hybrid_path, vocab, config):
    """Snapshots are copied between steps out of and into the slots captured graphs read in place;
    greedy tokens equal a cold GPU run's (logprobs within TF32-level noise: chunkings differ)."""
    gpu = {"device": "cuda", "dtype": "float32", "kv_cache_memory": 64 << 20, "speculative_config": config or {}}
    (turn1,) = prompts(vocab, [45], seed=27)
    warm = engine(hybrid_path, **gpu)
    assert warm.engine.runner.graphs is not None
    cold_gpu = engine(hybrid_path, enable_prefix_caching=False, **gpu)
    first = greedy(warm, turn1, 20)
    assert_same(first, greedy(cold_gpu, turn1, 20), tol=1e-2)
    turn2 = turn1 + list(first.outputs[0].token_ids) + turn1[:7]
    second = greedy(warm, turn2, 20)
    assert second.num_cached_tokens == 64
    assert_same(second, greedy(cold_gpu, turn2, 20), tol=1e-2)
    assert_same(greedy(warm, turn1, 20), first, tol=1e-2)
    assert sum(warm.engine.runner.graphs.replays.values()) > 0
