"""KVFlash page-ins during decode overlap the steps launched meanwhile: a new resident set waits beside
the old one until its copies land, then takes over before the next step; prompt chunks switch at once;
a sequence leaving with a page-in in flight gives its blocks back."""
from __future__ import annotations

import torch

from lucebox import SamplingParams
from lucebox.model.kv_pool.score import ChunkSummaries
from tests.engine.test_kv_pool_engine import pooled_llm, prompt, qwen3_path  # noqa: F401 (fixtures)


def shuffled_scores(monkeypatch):
    """A tiny random model's queries barely move: random scores make every choice bring chunks back."""
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(ChunkSummaries, "scores", lambda self, q: torch.rand(self.count, generator=generator))


def started(path, prompt, monkeypatch, **kw):
    """A pooled engine with shuffled scores, one request of 200 greedy tokens admitted and prefilled:
    (engine, pool, seq, its Residency)."""
    shuffled_scores(monkeypatch)
    engine = pooled_llm(path, **kw).engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=200,
                                                                         ignore_eos=True))
    seq = engine.requests["r"][1][0]
    engine.step()  # admitted (enrolled) and prefilled
    return engine, engine.kv_pool, seq, engine.kv_pool.members[id(seq)]


def test_a_decode_page_in_takes_over_at_the_next_step_and_blocks_come_back(qwen3_path, prompt, monkeypatch):
    engine, pool, seq, member = started(qwen3_path, prompt, monkeypatch)
    free = pool.blocks.num_free_blocks + pool.blocks.held(seq.block_table) + pool.in_flight(seq)  # before admission
    page_ins = 0
    while engine.has_unfinished():
        engine.step()
        page = member.pending
        if page is None or seq.is_finished:
            continue
        page_ins += 1
        view, table = seq.kv_view, list(seq.block_table)
        assert all(table[i] == pool.blocks.released for i in page.enter)  # not yet in the table
        assert not set(page.blocks) & set(table)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the side stream's copies done (on the CPU they are when load returns)
        pool.land()  # the new set takes over, the leaving blocks go back
        assert member.pending is None and seq.kv_view != view
        assert [seq.block_table[i] for i in page.enter] == page.blocks
        assert all(seq.block_table[i] == pool.blocks.released for i in page.evict)
    assert page_ins >= 2
    assert pool.blocks.num_free_blocks == free and pool.store.num_free == pool.store.num_host_blocks


def test_prompt_chunks_switch_at_once(qwen3_path, prompt, monkeypatch):
    shuffled_scores(monkeypatch)
    llm = pooled_llm(qwen3_path, max_num_batched_tokens=128)
    engine, pool = llm.engine, llm.engine.kv_pool
    engine.add_request("r", {"prompt_token_ids": prompt * 2}, SamplingParams(temperature=0, max_tokens=1))
    seq = engine.requests["r"][1][0]
    engine.step()
    member, reselects = pool.members[id(seq)], []
    while seq.num_computed < len(prompt) * 2 - 128:
        engine.step()
        assert member.pending is None
        reselects.append(pool.reselects)
    assert reselects[-1] > 2 and pool.paged_in > 0  # chunks came back, each at the chunk's end


def test_a_sequence_leaving_mid_page_in_gives_its_blocks_back(qwen3_path, prompt, monkeypatch):
    engine, pool, seq, member = started(qwen3_path, prompt, monkeypatch)
    free = pool.blocks.num_free_blocks + pool.blocks.held(seq.block_table) + pool.in_flight(seq)  # before admission
    while member.pending is None:
        engine.step()
    engine.abort("r")
    assert pool.members == {} and pool.blocks.num_free_blocks == free
    assert pool.store.num_free == pool.store.num_host_blocks


def test_blocks_in_flight_count_as_held(qwen3_path, prompt, monkeypatch):
    engine, pool, seq, member = started(qwen3_path, prompt, monkeypatch)
    while member.pending is None:
        engine.step()
    cache = engine.scheduler.cache
    in_table = pool.blocks.held(seq.block_table)
    assert cache.held_blocks(seq) == in_table + len(member.pending.blocks) > in_table


def test_page_ins_stay_within_the_blocks_the_plan_gives_a_sequence(qwen3_path, prompt, monkeypatch):
    # room for 512 + 128 + 64 tokens a sequence
    engine, pool, seq, _ = started(qwen3_path, prompt, monkeypatch, max_num_batched_tokens=128)
    paged, in_flight = pool.paged_in, 0
    while engine.has_unfinished():
        engine.step()
        if seq.is_finished:
            break
        assert engine.scheduler.cache.held_blocks(seq) <= pool.planned_blocks  # page-ins in flight included
        in_flight += pool.in_flight(seq) > 0
    assert pool.paged_in > paged and in_flight  # chunks came back during decode, some of them overlapped
