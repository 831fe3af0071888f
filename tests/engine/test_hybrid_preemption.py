"""Preemption of a hybrid (Gated DeltaNet) sequence: a KV pool too small for the batch sends the
newest running sequence back to waiting; its recurrent-state slot goes back to the pool with its
blocks, and on readmission it gets a slot reset to the zero state and recomputes its prompt and
output so far. Its output is token-identical to a run that never preempted (plain decoding, and
DFlash speculation, whose taps are recaptured by the recompute)."""
from __future__ import annotations

import pytest

from lucebox import LLM, SamplingParams
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import BLOCK_SIZE, HYBRID, prompts
from tests.spec_fixtures import write_dflash_drafter

MAX_LEN, POOL_BLOCKS, SEQS = 48, 15, 3  # 12 blocks a sequence at most; three of ~9 never fit in 15


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("hybrid_preempt"), tokenizer_dir, **HYBRID)


def engine(path, speculative_config=None, blocks: int | None = None) -> LLM:
    kwargs = dict(block_size=BLOCK_SIZE, max_model_len=MAX_LEN, max_num_seqs=SEQS, max_num_batched_tokens=32,
                  speculative_config=speculative_config or {})
    if blocks is not None:  # a pool of exactly `blocks` blocks beside the fixed-size recurrent state
        probe = LLM(str(path), **kwargs).engine.scheduler.cache
        kwargs["kv_cache_memory"] = (probe.bytes_per_sequence * SEQS + probe.snapshot_bytes
                                     + probe.bytes_per_token * BLOCK_SIZE * blocks)
    return LLM(str(path), **kwargs)


def record_slots(llm) -> list[tuple[str, str, int]]:
    """(event, request id, slot) of every admission and release, with the admitted slot's state
    checked to start at zero unless a prefix hit loaded a snapshot (tests/engine/test_hybrid_prefix.py)."""
    cache, events = llm.engine.scheduler.cache, []
    admit, free = cache.admit, cache.free

    def admitting(seq, cached):
        admit(seq, cached)
        slot = cache.slot(seq)
        assert cached or all(s.state[slot].abs().sum() == 0 and s.conv[slot].abs().sum() == 0 for s in cache.states)
        events.append(("admit", seq.request_id, slot))

    def freeing(seq):
        events.append(("free", seq.request_id, cache.slots.get(id(seq))))
        free(seq)
    cache.admit, cache.free = admitting, freeing
    return events


@pytest.mark.parametrize("method", ["plain", "dflash"])
def test_a_preempted_hybrid_sequence_resumes_token_identical(method, hybrid_path, tmp_path):
    config = None
    if method == "dflash":
        drafter = write_dflash_drafter(hybrid_path, tmp_path / "d", taps=(0, 2), block_size=4)
        config = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3, "adaptive": False}
    batch = prompts(engine(hybrid_path).engine.loaded.config.vocab_size, [9, 6, 11], seed=4)
    # Logprobs too: a tiny random model's argmax could survive a stale recurrent state; they could not.
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in batch]
    roomy = engine(hybrid_path, config)
    reference = roomy.generate(requests, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in reference]
    assert roomy.engine.scheduler.num_preemptions == 0

    tight = engine(hybrid_path, config, blocks=POOL_BLOCKS)
    assert tight.engine.runner.num_blocks == POOL_BLOCKS
    events = record_slots(tight)
    outs = tight.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for out, ref in zip(outs, reference):
        got = [v.logprob for d in out.outputs[0].logprobs for v in d.values()]
        assert got == pytest.approx([v.logprob for d in ref.outputs[0].logprobs for v in d.values()], abs=1e-4)
    assert tight.engine.scheduler.num_preemptions > 0
    # Some request freed its slot while unfinished and was admitted again later, then finished.
    resumed = {rid for kind, rid, _ in events if kind == "admit"
               if sum(1 for k, r, _ in events if k == "admit" and r == rid) > 1}
    assert resumed
    for rid in resumed:
        mine = [kind for kind, r, _ in events if r == rid]
        assert mine[:3] == ["admit", "free", "admit"] and mine[-1] == "free"
    cache = tight.engine.scheduler.cache
    assert not cache.slots and len(cache.free_slots) == SEQS  # every slot back in the pool
