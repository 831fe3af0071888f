"""Models mixing sliding-window and full-attention layers (Gemma 4, Laguna; here Qwen2 with
`layer_types`): each window is a KV cache group with its own pool and tables, holding only its
window, while the full-attention layers keep the context. Logits stay transformers' (float32,
1e-4) through prefill, chunked prefill, decode and verify with rejections, on the eager and the
padded static (CUDA-graph) paths, with released blocks poisoned with NaN."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.cache_manager import CacheManager
from lucebox.engine.graph_settings import GraphSettings
from lucebox.engine.runner import ModelRunner
from lucebox.engine.sequence import Sequence
from lucebox.engine.step_plan import StepPlan
from lucebox.model.cache_spec import PagedKVSpec, bytes_per_token, kv_groups, plan_pools, window_blocks
from lucebox.model.loader import load_model

from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import reference_logits

WINDOW, BLOCK, NEW = 6, 4, 40
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
KV_MEMORY = 8 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed(tokenizer_dir, tmp_path_factory):
    return str(build_hf_model("qwen2", tmp_path_factory.mktemp("qwen2-mixed"), tokenizer_dir, seed=5,
                              num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, sliding_window=WINDOW))


@pytest.fixture(scope="module")
def reference(mixed):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(mixed, dtype=torch.float32)


def reference_greedy(reference, prompt: list[int], new: int = NEW) -> list[int]:
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(n: int = 6, seed: int = 1) -> list[dict]:
    g = random.Random(seed)
    return [{"prompt_token_ids": [g.randrange(380) for _ in range(g.choice([3, 11, 26, 37]))]} for _ in range(n)]


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


class Driver:
    """One sequence stepped by hand through a CacheManager and a ModelRunner of the mixed model, as
    the engine would (grow, run, commit, roll back); after every commit, each free block of the
    window pools (and their scratch block) is filled with NaN, so reading one poisons the logits."""

    def __init__(self, path: str, pools=(64, 12), graphs: GraphSettings | None = None, device: str = "cpu"):
        self.model = load_model(path, dtype="float32", device=device).model
        specs = self.model.cache_specs()
        self.groups = kv_groups(specs)
        self.cache = CacheManager(specs, list(pools), BLOCK)
        self.runner = ModelRunner(self.model, pools[0], BLOCK, groups=self.groups, group_blocks=list(pools[1:]),
                                  graphs=graphs)
        self.seq = Sequence("r", 0, [], SamplingParams())
        self.cache.admit(self.seq, [])
        self.window_layers = [i for i, layer in enumerate(self.runner.paged_layers)
                              if self.runner.layer_group[layer] > 0]

    def run(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every new token, at positions num_computed..."""
        seq = self.seq
        start = seq.num_computed
        self.cache.grow(seq, start + len(tokens))
        plan = StepPlan.forward([tokens], [start], [seq.block_table], [seq.window_tables], all_logits=True)
        return self.runner.run(plan).logits

    def commit(self, tokens: list[int]) -> None:
        seq = self.seq
        seq.prompt_token_ids.extend(tokens)  # the committed tokens (hashed for the prefix cache)
        seq.num_computed += len(tokens)
        self.cache.commit(seq)
        self.poison()

    def poison(self) -> None:
        pool = self.cache.window_pools[0]
        free = torch.tensor(list(pool.free) + [pool.released], device=self.model.device)
        for i in self.window_layers:
            for store in self.runner.caches[i]:
                store.values[free] = float("nan")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-batches"])
def test_logits_match_transformers_through_chunks_decode_and_rejected_drafts(mixed, reference, graphs):
    settings = GraphSettings(max_model_len=96, max_batch=2, query_lens=(1, 5), capture=False) if graphs else None
    run = Driver(mixed, graphs=settings)
    assert [g.window for g in run.groups] == [None, WINDOW] and run.runner.layer_group == {0: 1, 1: 0, 2: 1, 3: 0}
    g = torch.Generator().manual_seed(3)
    sequence = torch.randint(0, 380, (60,), generator=g).tolist()
    want = reference_logits(reference, sequence)
    checked = []

    def check(tokens, rows=None):
        start = run.seq.num_computed
        got = run.run(tokens)
        rows = len(tokens) if rows is None else rows
        torch.testing.assert_close(got[:rows], want[start:start + rows], atol=1e-4, rtol=0)
        checked.append(start + rows)

    for chunk in (sequence[0:9], sequence[9:23]):  # chunked prefill past the window
        check(chunk)
        run.commit(chunk)
    for p in range(23, 30):  # decodes
        check([sequence[p]])
        run.commit([sequence[p]])
    held = run.cache.held_by_group(run.seq)
    # verify [pending, 4 drafts]: the first draft right, the rest wrong; rows past it see the wrong ones
    pending, drafts = sequence[30], [sequence[31], 7, 8, 9]
    check([pending] + drafts, rows=2)
    run.commit([pending, drafts[0]])
    run.cache.rollback(run.seq, run.seq.num_computed + 1, accepted=1)  # the rejected drafts' blocks go
    assert run.cache.held_by_group(run.seq)[1] <= window_blocks(WINDOW, BLOCK, 1)
    check(sequence[32:37])  # a verify where all is right: overwrites the rejected drafts' K/V
    run.commit(sequence[32:37])
    for p in range(37, 60):
        check([sequence[p]])
        run.commit([sequence[p]])
    after = run.cache.held_by_group(run.seq)
    assert after[0] == -(-60 // BLOCK) > held[0]  # the full-attention group grows with the context
    assert after[1] <= -(-WINDOW // BLOCK) + 1 >= held[1]  # the window group stays a window
    if graphs:
        assert sum(run.runner.graphs.replays.values()) > 20  # decodes and verifies took the padded batches


def test_rows_without_window_tables_are_refused(mixed):
    run = Driver(mixed)
    with pytest.raises(ValueError, match="2 KV cache groups"):
        run.runner.run(StepPlan.forward([[1, 2]], [0], [run.seq.block_table], all_logits=True))


def watch_groups(llm) -> list[list[int]]:
    """Every step: each decoding sequence's blocks per group, once its step's room is taken."""
    held, schedule, cache = [], llm.engine.scheduler.schedule, llm.engine.scheduler.cache

    def spy():
        batch = schedule()
        held.extend(cache.held_by_group(s) for s, n in zip(batch.seqs, batch.num_new_tokens) if n == 1)
        return batch

    llm.engine.scheduler.schedule = spy
    return held


def assert_pools_empty(llm):
    cache = llm.engine.scheduler.cache
    for pool in [cache.blocks, *cache.window_pools]:
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_count == 0 for b in pool.blocks)


@pytest.fixture(scope="module")
def greedy_reference(mixed, reference):
    return [reference_greedy(reference, p["prompt_token_ids"]) for p in prompts()]


def test_engine_greedy_equals_transformers_with_flat_window_blocks(mixed, greedy_reference):
    llm = LLM(mixed, block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    cache = llm.engine.scheduler.cache
    assert cache.windows == [WINDOW] and cache.release_window is None
    held = watch_groups(llm)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert ids(outs) == greedy_reference
    longest = max(len(p["prompt_token_ids"]) for p in prompts()) + NEW - 1
    assert max(h[0] for h in held) == -(-longest // BLOCK)  # full layers: the whole context
    assert max(h[1] for h in held) <= -(-WINDOW // BLOCK) + 1  # window layers: flat, whatever the length
    assert_pools_empty(llm)


def test_chunked_prefill_and_ngram_verify_with_rejections(mixed, reference):
    repeated = [{"prompt_token_ids": p["prompt_token_ids"] * 3} for p in prompts(seed=2)]
    want = [reference_greedy(reference, p["prompt_token_ids"]) for p in repeated]
    chunked = LLM(mixed, block_size=BLOCK, kv_cache_memory=KV_MEMORY, max_num_batched_tokens=5)
    assert ids(chunked.generate(repeated, GREEDY, use_tqdm=False)) == want
    llm = LLM(mixed, block_size=BLOCK, kv_cache_memory=KV_MEMORY,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                  "adaptive": False})
    outs = llm.generate(repeated, GREEDY, use_tqdm=False)
    assert ids(outs) == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > accepted > 0  # some drafts were rejected and rolled back
    assert_pools_empty(llm)


def test_prefix_cache_hits_stay_exact(mixed, greedy_reference):
    llm = LLM(mixed, block_size=BLOCK, kv_cache_memory=KV_MEMORY)
    first = ids(llm.generate(prompts(), GREEDY, use_tqdm=False))
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert first == ids(again) == greedy_reference
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_pools_empty(llm)


def test_a_hit_is_shortened_to_what_the_window_group_still_holds():
    specs = [PagedKVSpec.of(2, 32, torch.float32, window=6), PagedKVSpec.of(2, 32, torch.float32)]
    cache = CacheManager(specs, [32, 8], BLOCK)
    first = Sequence("a", 0, list(range(24)), SamplingParams())
    cache.admit(first, [])
    cache.grow(first, 24)
    first.num_computed = 24
    cache.commit(first)
    cache.free(first)
    prompt = list(range(24)) + [99]
    hit = cache.match_prefix(prompt)
    # 6 blocks cached in the full group; the first query (position 24) reads keys 19..23: window blocks 4, 5
    assert len(hit) == 6 and [(skipped, len(blocks)) for skipped, blocks in hit.windows] == [(4, 2)]
    # evict window block 5 (the window pool hands its least recently freed blocks out first)
    pool, table = cache.window_pools[0], []
    pool.allocate(table, len(pool.free) * BLOCK)
    assert len(cache.match_prefix(prompt)) == 0  # k = 6, 5, ...: each needs a block no longer cached
    pool.free_table(table)
    second = Sequence("b", 0, prompt, SamplingParams())
    hit = cache.match_prefix(prompt)
    assert cache.can_admit(hit, 25)
    cache.admit(second, hit)
    assert len(second.block_table) == len(hit) and len(second.window_tables[0]) == len(hit)


def test_a_prompts_window_outlives_the_windows_its_output_slid_past():
    """A thinking model's next turn repeats the prompt, not the output: the window blocks a hit at the
    prompt's end reads join the free pool last, the ones decoding slid past first."""
    specs = [PagedKVSpec.of(2, 32, torch.float32, window=6), PagedKVSpec.of(2, 32, torch.float32)]
    cache = CacheManager(specs, [32, 8], BLOCK)
    seq = Sequence("a", 0, list(range(10)), SamplingParams())
    cache.admit(seq, [])
    cache.grow(seq, 10)
    seq.num_computed = 10
    cache.commit(seq)
    while seq.num_tokens < 30:  # decode: window blocks 0..5 released, 6 and 7 held
        seq.output_token_ids.append(100 + seq.num_tokens)
        cache.grow(seq, seq.num_tokens)
        seq.num_computed = seq.num_tokens
        cache.commit(seq)
    pool, other = cache.window_pools[0], []
    pool.allocate(other, (len(pool.free) - 2) * BLOCK)  # another sequence takes all but two free blocks
    next_turn = list(range(10)) + [7, 7]
    hit = cache.match_prefix(next_turn)  # the first query (position 8) reads keys 3..7: window blocks 0, 1
    assert len(hit) == 2 and [(skipped, len(blocks)) for skipped, blocks in hit.windows] == [(0, 2)]


def test_preemption_and_recompute(mixed, reference):
    g = random.Random(4)
    many = [{"prompt_token_ids": [g.randrange(380) for _ in range(g.randint(2, 5))]} for _ in range(12)]
    want = [reference_greedy(reference, p["prompt_token_ids"], 24) for p in many]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # 1 KiB a token over all four layers: 16 blocks for the window layers (4 windows and a step), 16 for
    # the full ones, which four sequences of up to 29 tokens outgrow
    llm = LLM(mixed, block_size=BLOCK, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory=16 * BLOCK * 1024)
    cache = llm.engine.scheduler.cache
    assert (cache.blocks.num_blocks, cache.window_pools[0].num_blocks) == (16, 16)
    assert ids(llm.generate(many, params, use_tqdm=False)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pools_empty(llm)


def test_memory_plan_gives_the_full_layers_what_windows_do_not_need(mixed, caplog):
    with caplog.at_level("INFO", logger="lucebox"):
        engine = LLM(mixed, block_size=BLOCK, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=16,
                     kv_cache_memory=1 << 20).engine
    specs = engine.scheduler.cache.specs
    shared = (1 << 20) // (bytes_per_token(specs) * BLOCK)  # one pool for every layer, as before: 256 blocks
    pools = [engine.scheduler.cache.blocks.num_blocks] + [p.num_blocks for p in engine.scheduler.cache.window_pools]
    # two sequences' windows and a step's chunk for the window layers; the rest holds full-layer tokens
    assert pools[1] == 2 * window_blocks(WINDOW, BLOCK, 1) + 16 // BLOCK == 10
    assert engine.kv_capacity_tokens == pools[0] * BLOCK == (2 * shared - pools[1]) * BLOCK  # about twice as many
    assert engine.runner.caches[0][0].values.shape[0] == pools[1] + 1  # layer 0 slides: its group's pool
    assert f"KV pool: {pools[0]} blocks of 4 tokens = {pools[0] * 4} tokens (full-attention layers)" in caplog.text
    assert "KV pool of 2 sliding-window layers (window 6): 10 blocks (0.0 MiB), the windows of 3 decoding" \
        in caplog.text
    assert engine.runner.caches[1][0].values.shape[0] == pools[0] + 1


def test_plan_pools_rules():
    full, slide = PagedKVSpec.of(2, 32, torch.float32), PagedKVSpec.of(2, 32, torch.float32, window=64)
    specs = [slide, slide, slide, full]
    groups = kv_groups(specs)
    per_block = bytes_per_token([full]) * 16
    # plenty: 4 windows of 5 blocks plus the step's 2 blocks; the full layer takes the rest
    pools = plan_pools(specs, groups, 10_000 * per_block, 16, 4, 32, 4096)
    assert pools[1] == 4 * window_blocks(64, 16, 1) + 2 and pools[0] == 10_000 - 3 * pools[1]
    # many sequences: never more window blocks than one shared pool would give (short contexts unchanged)
    pools = plan_pools(specs, groups, 400 * per_block, 16, 1000, 32, 256)
    assert pools == [100, 100]
    # a window wider than max_model_len (48 tokens: 3 blocks) holds at most a sequence
    pools = plan_pools(specs, groups, 10_000 * per_block, 16, 4, 32, 48)
    assert pools[1] == 4 * (3 + 1) + 2
    assert kv_groups([slide, PagedKVSpec.of(2, 32, torch.float32, window=8)]) == [
        type(groups[0])((0, 1), 64)]  # every layer windowed: one group, released behind the widest


def test_attention_without_kv_groups_keeps_one_table(mixed, greedy_reference):
    """A model whose attention modules do not read `kv_group` (not taught KV cache groups yet) runs
    as before: one table for every layer, nothing released, outputs exact."""
    from lucebox.config import EngineArgs
    from lucebox.engine.engine import LLMEngine
    loaded = load_model(mixed, dtype="float32")
    for layer in loaded.model.layers:
        del layer.self_attn.kv_group
    engine = LLMEngine(loaded, EngineArgs(model=mixed, block_size=BLOCK, kv_cache_memory=KV_MEMORY))
    cache = engine.scheduler.cache
    assert len(cache.groups) == 1 and cache.windows == [] and cache.release_window is None
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[str(i)] for i in range(len(prompts()))] == greedy_reference


def test_a_bare_primary_hit_is_refused_on_a_mixed_model():
    specs = [PagedKVSpec.of(2, 32, torch.float32, window=6), PagedKVSpec.of(2, 32, torch.float32)]
    cache = CacheManager(specs, [32, 8], BLOCK)
    with pytest.raises(ValueError, match="CachedPrefix"):
        cache.can_admit([3, 4], 12)


def test_dflash_captures_taps_every_step_on_a_mixed_model(mixed, reference, tmp_path):
    """A dormant DFlash drafter's catch-up would recompute old positions whose window blocks are
    released: on a mixed model the taps are captured in every step instead, so nothing is recomputed."""
    from tests.spec_fixtures import write_dflash_drafter
    drafter = write_dflash_drafter(Path(mixed), tmp_path / "drafter")
    repeated = [{"prompt_token_ids": p["prompt_token_ids"] * 2} for p in prompts(3, seed=9)]
    want = [reference_greedy(reference, p["prompt_token_ids"]) for p in repeated]
    llm = LLM(mixed, block_size=BLOCK, kv_cache_memory=KV_MEMORY,
              speculative_config={"method": "dflash", "model": str(drafter)})
    assert llm.engine.speculator.every_step and llm.engine.scheduler.cache.windows == [WINDOW]
    assert ids(llm.generate(repeated, GREEDY, use_tqdm=False)) == want
    assert_pools_empty(llm)


def test_the_default_cpu_budget_holds_a_whole_sequence_beside_the_window_pools():
    """The CPU budget is what the groups need (full context in the primary group, each window group's
    wish); sized for one shared pool, a large step's window room left the primary short of a sequence."""
    from lucebox.bench import shapes
    from lucebox.config import EngineArgs
    from lucebox.engine.engine import LLMEngine
    loaded = shapes.build_random_model("tiny-laguna", "bf16", torch.device("cpu"), torch.float32)
    engine = LLMEngine.from_args(EngineArgs(max_model_len=512, max_num_seqs=1, speculative_config={}), loaded)
    assert len(engine.scheduler.cache.groups) > 1
    assert engine.scheduler.cache.blocks.num_free_blocks * engine.args.block_size >= 512
