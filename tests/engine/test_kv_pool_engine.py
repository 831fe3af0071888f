"""KVFlash through the engine: a pool as large as the context changes nothing; a smaller one decodes exactly
what transformers decodes when the evicted positions are masked out of every step (the resident set the
engine chose before that step); host-backed blocks come back bit-exact; bad settings are refused clearly."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.engine.cuda_graphs import CudaGraphRunner
from lucebox.errors import ContextLengthError, RequestError, UnsupportedError
from lucebox.model.kv_pool.score import ChunkSummaries

from tests.conftest import build_hf_model

BLOCK = 16
# For tests that keep several engines alive at once: each bounds its KV (on a GPU an engine's default pool
# is 90% of the card less what is in use, which leaves the next engine none).
BESIDE = {"kv_cache_memory": 256 << 20}
# The bundled model is bf16 on a GPU, where a verify's and a decode's kernels round differently and greedy
# can part at a near-tie: token identity is asserted in float32 (the CPU's dtype anyway).
EXACT = {"dtype": "float32"}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("pool-target"), tokenizer_dir, seed=3,
                          max_position_embeddings=4096)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 380, (700,), generator=torch.Generator().manual_seed(7)).tolist()


def pooled_llm(path, **kw) -> LLM:
    args = dict(block_size=BLOCK, max_model_len=2048, kv_pool_tokens=512, kv_pool_target=True,
                kv_reselect_interval=16, max_num_batched_tokens=1024, speculative_config={})
    args.update(kw)
    return LLM(str(path), **args)


def run_recording_views(llm: LLM, ids: list[int], params: SamplingParams):
    """Step the engine; per generated token, the logical positions attention read for it (None: all)."""
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": ids}, params)
    seq = engine.requests["r"][1][0]
    resident, views = [], []
    while engine.has_unfinished():
        engine.kv_pool.land()  # what the step lands first: the resident set it reads
        view = seq.kv_view
        table_len = -(-(seq.num_computed + 1) // BLOCK)
        blocks = None if view is None else view.blocks(table_len)
        resident.append(None if blocks is None else {b * BLOCK + o for b in blocks for o in range(BLOCK)})
        views.append(view)
        done = [o for o in engine.step() if o.finished]
    return done[0], resident, views


def masked_reference(path, ids: list[int], resident: list, new_tokens: int):
    """transformers: the prompt prefilled exactly, then each token decoded with the positions outside that
    step's resident set masked out (eager attention, explicit 2D mask)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    tokens, logprobs = [], []
    with torch.no_grad():
        first = model(torch.tensor([ids]), use_cache=True)  # the model's own cache kind (hybrids: recurrent state)
        logits, cache = first.logits[0, -1], first.past_key_values
        for i in range(new_tokens):
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(logits.log_softmax(-1)[token]))
            if i + 1 == new_tokens:
                break
            length = len(ids) + i + 1
            keep = resident[i + 1]
            mask = torch.tensor([[1 if keep is None or p in keep or p == length - 1 else 0 for p in range(length)]])
            logits = model(torch.tensor([[token]]), past_key_values=cache, attention_mask=mask,
                           position_ids=torch.tensor([[length - 1]]), use_cache=True).logits[0, -1]
    return tokens, logprobs


def test_a_pool_as_large_as_the_context_is_token_identical(qwen3_path, prompt):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(qwen3_path), block_size=BLOCK, max_model_len=2048, speculative_config={}, **BESIDE)
    want = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = pooled_llm(qwen3_path, kv_pool_tokens=1024)
    got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_pooled_decode_equals_attention_over_the_resident_positions(qwen3_path, prompt, monkeypatch):
    steps = 100  # the resident set is chosen again every 3-4 blocks: blocks come back from host memory
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0)
    # a tiny random model's queries barely move: shuffled scores make every choice differ (blocks come back)
    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(ChunkSummaries, "scores", lambda self, q: torch.rand(self.count, generator=generator))
    out, resident, views = run_recording_views(pooled_llm(qwen3_path), prompt, params)
    completion = out.outputs[0]
    assert resident[0] is None  # the first token comes from the exact prefill (one chunk)
    evicted = [set(range(len(prompt))) - r for r in resident[1:] if r is not None]
    assert evicted and all(len(e) >= len(prompt) - 512 for e in evicted)
    # some position left the resident set and came back: a host round trip fed later steps
    assert any(p in later for i, e in enumerate(evicted) for p in e for later in resident[i + 2:] if later is not None)
    tokens, logprobs = masked_reference(qwen3_path, prompt, resident, steps)
    assert completion.token_ids == tokens
    got = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
    assert got == pytest.approx(logprobs, abs=2e-4)


def test_chunked_prefill_evicts_as_it_goes_and_the_device_holds_only_the_pool(qwen3_path, prompt):
    llm = pooled_llm(qwen3_path, max_num_batched_tokens=128)
    engine = llm.engine
    long = prompt * 2
    engine.add_request("r", {"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seq = engine.requests["r"][1][0]
    held = []
    while engine.has_unfinished():
        engine.step()
        held.append(engine.scheduler.cache.held_blocks(seq) if not seq.is_finished else 0)
    # the pool (32 blocks), a prompt chunk's and a chunk's more at most, never the whole prompt (88)
    assert 0 < max(held) <= 512 // BLOCK + 128 // BLOCK + 64 // BLOCK < len(long) // BLOCK


def test_unpooled_requests_are_bounded_by_the_device_kv(qwen3_path, prompt):
    llm = pooled_llm(qwen3_path, kv_pool_target=False, max_model_len=4096, kv_cache_memory=600 * 1024,
                     max_num_batched_tokens=128)
    room = llm.engine.kv_capacity_tokens
    assert room < 4096
    long = (prompt * 8)[:room + 10]
    with pytest.raises(ContextLengthError, match="kv_pool"):
        llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=4), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": long, "kv_pool": True},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bad_pool_settings_are_refused_with_their_names(qwen3_path):
    with pytest.raises(RequestError, match="multiple of 64"):
        pooled_llm(qwen3_path, kv_pool_tokens=500)
    with pytest.raises(RequestError, match="smallest pool"):
        pooled_llm(qwen3_path, kv_pool_tokens=256)
    with pytest.raises(RequestError, match="kv_pool_target needs kv_pool_tokens"):
        pooled_llm(qwen3_path, kv_pool_tokens=0)
    plain = LLM(str(qwen3_path), block_size=BLOCK, max_model_len=1024, speculative_config={})
    with pytest.raises(UnsupportedError, match="--kv-pool-tokens"):
        plain.generate({"prompt_token_ids": [1, 2, 3], "kv_pool": True}, SamplingParams(max_tokens=2),
                       use_tqdm=False)
    with pytest.raises(RequestError, match="kv_pool must be true or false"):
        plain.generate({"prompt_token_ids": [1, 2, 3], "kv_pool": "yes"}, SamplingParams(max_tokens=2),
                       use_tqdm=False)


def test_pooled_rows_run_in_graph_buckets_and_overlapped_steps_as_eagerly(qwen3_path, prompt):
    runs = {}
    for logprobs in (0, None):  # logprobs: logits come back; none: argmax in the graph, steps launched ahead
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=logprobs)
        for graphs in (False, True):
            llm = pooled_llm(qwen3_path, cuda_graphs=graphs, **BESIDE)
            if graphs:  # on the CPU: the padded static batches a graph replays, uncaptured
                runner = llm.engine.runner
                runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                                replace(llm.engine._graph_settings(), capture=False))
            out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
            lps = [e[t].logprob for t, e in zip(out.token_ids, out.logprobs)] if logprobs is not None else None
            runs[logprobs, graphs] = (out.token_ids, lps, dict(llm.engine.step_counts))
            if graphs:  # every decode through a bucket, those capturing queries for a resident-set choice too
                graph_runner = llm.engine.runner.graphs
                assert sum(graph_runner.replays.values()) >= 59 and llm.engine.kv_pool.reselects >= 2
                assert any(key[5] for key in graph_runner.graphs)  # a bucket that hands back queries
    assert runs[0, True][0] == runs[0, False][0] == runs[None, True][0] == runs[None, False][0]
    assert runs[0, True][1] == pytest.approx(runs[0, False][1], abs=1e-5)
    assert runs[None, True][2].get("overlapped", 0) > 10  # launched ahead through the resident view


def test_dflash_speculates_on_a_pooled_target(prompt):
    """The bundled pair: the drafter's own K/V are host-backed with the target's and read through its view."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ids = [t % 1000 + 10 for t in prompt * 2]
    plain = LLM(max_model_len=2048, block_size=BLOCK, kv_pool_tokens=2048, speculative_config={}, **EXACT, **BESIDE)
    want = plain.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    whole = LLM(max_model_len=2048, block_size=BLOCK, kv_pool_tokens=2048, kv_pool_target=True, **EXACT, **BESIDE)
    assert whole.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == want
    llm = LLM(max_model_len=2048, block_size=BLOCK, kv_pool_tokens=512, kv_pool_target=True, kv_reselect_interval=32)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 48
    assert llm.engine.kv_pool.members == {} and llm.engine.kv_pool.store.num_free == llm.engine.kv_pool.store.num_host_blocks
    assert llm.engine.step_counts["verify"] > 0


def test_draft_trees_verify_through_a_pooled_view(prompt):
    from lucebox.default_model import BUNDLED_DRAFTER
    trees = {"method": "dflash", "model": str(BUNDLED_DRAFTER), "tree_budget": 16}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [t % 1000 + 10 for t in prompt * 2]
    plain = LLM(max_model_len=2048, block_size=BLOCK, speculative_config={}, **EXACT, **BESIDE)
    want = plain.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    whole = LLM(max_model_len=2048, block_size=BLOCK, kv_pool_tokens=2048, kv_pool_target=True,
                speculative_config=trees, **EXACT, **BESIDE)
    assert whole.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == want
    llm = LLM(max_model_len=2048, block_size=BLOCK, kv_pool_tokens=512, kv_pool_target=True, kv_reselect_interval=32,
              speculative_config=trees)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40 and llm.engine.kv_pool.reselects > 1
    assert llm.engine.step_counts["verify"] > 0
