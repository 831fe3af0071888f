"""CUDA-graph decode and verify steps compute what eager steps compute.

Everything but the capture itself runs on the CPU: bucket choice, the padded static layout, the
padded batch through the model (GraphSettings(capture=False) runs the very batches a graph would
replay, eagerly), and the graph-safe Triton attention under TRITON_INTERPRET=1. Tests marked
`gpu` capture and replay real graphs and skip without CUDA.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # before any Triton import; see test_triton_kernels.py
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox import LLM, SamplingParams  # noqa: E402
from lucebox.engine.block_manager import BlockManager  # noqa: E402
from lucebox.engine.cuda_graphs import CudaGraphRunner, GraphSettings, batch_buckets  # noqa: E402
from lucebox.engine.graph_io import StaticInputs  # noqa: E402
from lucebox.engine.overlap import AheadStep  # noqa: E402
from lucebox.engine.runner import ModelRunner  # noqa: E402
from lucebox.engine.step_plan import StepPlan  # noqa: E402
from lucebox.kernels.attention import paged_attention  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402
from lucebox.model.config import ModelConfig  # noqa: E402
from lucebox.model.kv_cache import PagedKVCache  # noqa: E402
from lucebox.model.transformer import Transformer  # noqa: E402
from lucebox.sampling.graph_rows import graph_row, graph_samplable  # noqa: E402

gpu = pytest.mark.skipif(not ON_GPU, reason="captures CUDA graphs")
BLOCK = 4
PROMPT_LENS = [9, 13, 3, 6, 11, 2, 7, 5, 10, 4, 8, 12, 3, 9, 6, 14, 5]  # up to 17 sequences
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def tiny_model(device="cpu", dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, sliding_windows=[None, 6])
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.to(device, dtype)


def prefilled(model, settings: GraphSettings | None, num_seqs: int, room: int = 8, **cache):
    """A runner over `model` whose sequences have their prompts in the cache; returns
    (runner, tables, context lengths)."""
    runner = ModelRunner(model, 128, BLOCK, graphs=settings, **cache)
    blocks = BlockManager(128, BLOCK)
    lens = PROMPT_LENS[:num_seqs]
    tables = [[] for _ in lens]
    for table, n in zip(tables, lens):
        blocks.allocate(table, n + room)
    runner.run_eager(StepPlan.forward([[(7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate(lens)],
                                      [0] * num_seqs, tables))
    return runner, tables, lens


def step_tokens(q_lens: list[int]) -> list[list[int]]:
    return [[(11 * i + j) % 90 + 1 for j in range(q)] for i, q in enumerate(q_lens)]


# ----------------------------------------------------------------------------- buckets and padding

def test_batch_buckets_double_up_to_the_largest():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(1) == [1]


@pytest.mark.parametrize("q_lens, bucket", [
    ([1, 1, 1], (4, 1)),  # decode: batch padded to the next bucket
    ([1] * 8, (8, 1)),
    ([4, 4], (2, 4)),  # verify with 3 drafts each
    ([2, 4, 4], (4, 4)),  # a shorter draft is padded within its sequence
    ([3], (1, 4)),  # no bucket of 3 tokens: the next one up
    ([4, 1, 1, 1], None),  # 16 padded tokens for 7 real ones: cheaper eagerly
    ([5], None),  # longer than any query bucket (a prefill chunk)
    ([1] * 9, None),  # more sequences than the largest bucket
    ([1, 0], None),  # a sequence without new tokens
])
def test_a_step_takes_the_smallest_bucket_that_holds_it(q_lens, bucket):
    graphs = CudaGraphRunner(tiny_model(), BLOCK, 0, GraphSettings(64, max_batch=8, query_lens=(1, 4), capture=False))
    tables = [[1, 2, 3]] * len(q_lens)
    assert graphs.bucket(step_tokens(q_lens), [5] * len(q_lens), tables) == bucket


def test_steps_past_the_block_table_width_run_eagerly():
    graphs = CudaGraphRunner(tiny_model(), BLOCK, 0, GraphSettings(16, max_batch=4, query_lens=(1,), capture=False))
    assert graphs.width == 5  # ceil((16 + 1) / 4)
    assert graphs.bucket([[1]], [15], [[1, 2, 3, 4]]) == (1, 1)
    assert graphs.bucket([[1]], [20], [[1, 2, 3, 4, 5, 6]]) is None


def test_static_inputs_pad_missing_rows_and_tokens_into_the_scratch_block():
    inputs = StaticInputs(max_tokens=12, max_seqs=4, width=3, device=torch.device("cpu"))
    scratch = 9
    # sequence 0: 2 new tokens at positions 5, 6 (blocks 3 then 7); sequence 1: 3 new at 0..2 (block 2)
    real = inputs.fill([[11, 12], [21, 22, 23]], [5, 0], [[1, 3], [2]], 3, 3, BLOCK, scratch)
    inputs.upload(3)
    assert real == [0, 1, 3, 4, 5]
    assert inputs.view("ids", 9).tolist() == [11, 12, 0, 21, 22, 23, 0, 0, 0]
    assert inputs.view("positions", 9).tolist() == [5, 6, 0, 0, 1, 2, 0, 0, 0]
    pad = [scratch * BLOCK + j for j in range(3)]
    assert inputs.view("slots", 9).tolist() == [3 * BLOCK + 1, 3 * BLOCK + 2, pad[2],
                                                2 * BLOCK, 2 * BLOCK + 1, 2 * BLOCK + 2] + pad
    assert inputs.view("seq_lens", 3).tolist() == [5 + 3, 0 + 3, 3]  # padding counts: a uniform layout
    assert inputs.tables[:3].tolist() == [[1, 3, scratch], [2, scratch, scratch], [scratch] * 3]


# ----------------------------------------------------------------------------- padded batches on the CPU

STEPS = {  # name: (q_lens, run kwargs)
    "decode-3": ([1, 1, 1], {}),
    "decode-5-with-taps": ([1] * 5, {"capture_layers": (0, 1)}),
    "verify-2": ([4, 4], {"all_logits": True}),
    "verify-ragged-rows": ([2, 4, 3], {"logits_rows": [0, 1, 4, 5, 6, 8]}),
    "verify-with-taps": ([4, 2], {"all_logits": True, "capture_layers": (1,)}),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_padded_static_batch_gives_the_eager_logits(step):
    q_lens, kwargs = STEPS[step]
    settings = GraphSettings(64, max_batch=8, query_lens=(1, 4), capture=False)
    runner, tables, lens = prefilled(tiny_model(), settings, len(q_lens))
    args = (step_tokens(q_lens), lens, tables)
    got = runner.run(StepPlan.forward(*args, **kwargs))
    want = runner.run_eager(StepPlan.forward(*args, **kwargs))
    assert sum(runner.graphs.replays.values()) == 1  # it did take the static path
    pairs = [(got.logits, want.logits)] + ([(got.features, want.features)] if "capture_layers" in kwargs else [])
    assert (got.features is None) == ("capture_layers" not in kwargs)
    for g, w in pairs:
        assert g.shape == w.shape and rel_err(g, w) <= 1e-5


def test_the_device_only_reference_attention_matches_the_ragged_one():
    """The torch attention of a device-only batch (masks over the whole table) equals the per-sequence one."""
    q_lens, cached = [1, 3, 2], [13, 6, 0]
    q, k_cache, v_cache, batch, static, real = attention_case(q_lens, cached, query_len=3, num_seqs=4)
    for window in (None, 5):
        want = paged_attention(q, k_cache, v_cache, batch, 0.25, window)
        got = paged_attention(padded_queries(q, real, static), k_cache, v_cache, static, 0.25, window)
        assert rel_err(got[real], want) <= 1e-5


def attention_case(q_lens, cached, query_len, num_seqs, cache_type="f32", dtype=torch.float32,
                   device="cpu", width=8):
    """Caches with each sequence's context and new tokens written, plus the ragged batch and the
    padded device-only batch of the same step; returns (q, k, v, ragged, static, real rows)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, num_blocks = 4, 2, 32, 24
    caches = [PagedKVCache(num_blocks + 1, BLOCK, kv_heads, head_dim, cache_type, dtype, device) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for c, n in zip(cached, q_lens):
        need = -(-(c + n) // BLOCK)
        tables.append(order[:need])
        order = order[need:]
        slots = ForwardBatch.build([list(range(c + n))], [0], [tables[-1]], BLOCK, device).slot_mapping
        for cache in caches:
            cache.write(torch.randn(c + n, kv_heads, head_dim, generator=g).to(device, dtype), slots)
    ragged = ForwardBatch.build([[0] * n for n in q_lens], list(cached), tables, BLOCK, device)
    inputs = StaticInputs(num_seqs * query_len, num_seqs, width, torch.device(device))
    real = inputs.fill([[0] * n for n in q_lens], list(cached), tables, num_seqs, query_len, BLOCK, num_blocks)
    inputs.upload(num_seqs)
    tokens = num_seqs * query_len
    static = ForwardBatch.from_device(inputs.view("ids", tokens), inputs.view("positions", tokens),
                                      inputs.view("seq_lens", num_seqs), inputs.tables[:num_seqs],
                                      inputs.view("slots", tokens), BLOCK, query_len)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(device, dtype)
    return q, caches[0], caches[1], ragged, static, real


def padded_queries(q: torch.Tensor, real: list[int], static: ForwardBatch) -> torch.Tensor:
    out = torch.randn(static.num_tokens, *q.shape[1:], dtype=q.dtype, device=q.device)  # padding: anything
    out[real] = q
    return out


# ----------------------------------------------------------------------------- graph-safe Triton attention

TRITON_CASES = {  # name: (q_lens, cached, query_len, num_seqs, kernel kwargs)
    "decode": ([1, 1, 1], [13, 6, 30], 1, 4, {}),
    "verify-ragged": ([4, 2], [9, 0], 4, 2, {}),
    "empty-splits": ([1, 2], [2, 5], 2, 2, {"num_splits": 8, "block_kv": 16}),  # most splits see no keys
    "window-splits": ([3, 1], [25, 17], 3, 2, {"sliding_window": 6, "num_splits": 3, "block_kv": 16}),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_graph_safe_triton_attention_matches_the_torch_reference(case, monkeypatch):
    pytest.importorskip("triton")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    from lucebox.kernels import triton_paged_attention as tpa
    q_lens, cached, query_len, num_seqs, kwargs = TRITON_CASES[case]
    device = "cuda" if ON_GPU else "cpu"
    q, k_cache, v_cache, ragged, static, real = attention_case(q_lens, cached, query_len, num_seqs, device=device)
    window = kwargs.pop("sliding_window", None)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")  # the ragged torch reference, on any device
    want = paged_attention(q, k_cache, v_cache, ragged, 0.25, window)
    got = tpa.paged_attention(padded_queries(q, real, static), k_cache, v_cache, static, 0.25, window, **kwargs)
    assert rel_err(got[real], want) <= 1e-5


def test_a_padded_model_step_through_triton_kernels_matches_the_eager_reference(monkeypatch):
    """The whole model on a device-only batch with Triton kernels (interpreted on the CPU)."""
    pytest.importorskip("triton")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    device = "cuda" if ON_GPU else "cpu"
    settings = GraphSettings(64, max_batch=4, query_lens=(1, 4), capture=False)
    runner, tables, lens = prefilled(tiny_model(device), settings, 3)
    args = (step_tokens([2, 4, 3]), lens, tables)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want = runner.run_eager(StepPlan.forward(*args, all_logits=True)).logits
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got = runner.forward(*args, all_logits=True)
    assert runner.graphs.replays[(4, 4)] == 1 and rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("path", ["eager", "catch-up graph", "catch-up graph, shared inputs"])
def test_recomputing_taps_reads_the_cache_and_writes_none(path):
    """A StepPlan with write_kv=False, how a dormant drafter's missed taps are recomputed:
    positions already in the cache, forwarded again, give the taps the first pass captured, and
    every cache block but the scratch one is left bit for bit as it was -- eagerly, and through
    the padded catch-up bucket a graph replays (its own static inputs when it is longer than any
    step of the batch buckets, else the steps' ones). The last layer's K/V are changed after the first
    pass (the tap of layer 0 does not read them), so a pass that wrote its recomputed K/V would show."""
    settings = GraphSettings(64, max_batch=8 if "shared" in path else 2, query_lens=(1, 4), catch_up_lens=(8, 16),
                             capture=False)
    runner = ModelRunner(tiny_model(), 16, BLOCK, graphs=settings if path != "eager" else None)
    seq = [(5 * j) % 90 + 1 for j in range(30)]
    table: list[int] = []
    BlockManager(16, BLOCK).allocate(table, len(seq))
    first = runner.run_eager(StepPlan.forward([seq], [0], [table], all_logits=True, capture_layers=(0,))).features
    runner.caches[-1][0].values.add_(1.0)
    before = [(k.values.clone(), v.values.clone()) for k, v in runner.caches]
    again = runner.run(StepPlan.forward([seq[18:]], [18], [table], logits_rows=[], capture_layers=(0,),
                                        write_kv=False)).features
    if path != "eager":
        assert dict(runner.graphs.replays) == {(1, 16): 1}  # 12 positions, padded to the catch-up length 16
        assert (runner.graphs.long_inputs is None) == ("shared" in path)
    torch.testing.assert_close(again, first[18:], atol=2e-5, rtol=1e-4)
    for (k, v), (k0, v0) in zip(runner.caches, before):
        assert torch.equal(k.values[:16], k0[:16]) and torch.equal(v.values[:16], v0[:16])


# ----------------------------------------------------------------------------- the engine

def test_greedy_generation_through_padded_static_batches_equals_eager(hf_models, tmp_path):
    """Decodes and speculative verifies (with DFlash taps) through the static path, end to end."""
    from tests.spec_fixtures import write_dflash_drafter
    target = hf_models["qwen3"]
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:5])]
    spec = {"method": "dflash", "model": str(write_dflash_drafter(target, tmp_path / "dflash")), "adaptive": False}
    for config in (None, spec):
        llm = LLM(str(target), device="cpu", block_size=BLOCK, speculative_config=config, cuda_graphs=True)
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]  # eager on CPU
        runner = llm.engine.runner
        assert runner.graphs is None
        settings = replace(llm.engine._graph_settings(), capture=False)
        runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block, settings)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want
        assert sum(runner.graphs.replays.values()) > 0


def static_graph_llm(target, **kwargs) -> LLM:
    """An LLM on the CPU whose decode steps go through the padded static batches a graph replays."""
    llm = LLM(str(target), device="cpu", block_size=BLOCK, cuda_graphs=True, **kwargs)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                    replace(llm.engine._graph_settings(), capture=False))
    return llm


def count_ahead(engine, monkeypatch) -> dict:
    """Counts of decode steps launched ahead, and of those the next step used."""
    counts = {"launched": 0, "used": 0}
    launch = engine.overlap.launch_ahead
    monkeypatch.setattr(engine.overlap, "launch_ahead", lambda *a: (
        ahead := launch(*a), counts.__setitem__("launched", counts["launched"] + (ahead is not None)))[0])
    covers = AheadStep.covers
    monkeypatch.setattr(AheadStep, "covers", lambda self, *a: (
        hit := covers(self, *a), counts.__setitem__("used", counts["used"] + hit))[0])
    return counts


def test_overlapped_decoding_generates_what_step_by_step_decoding_does(hf_models, monkeypatch):
    """async_decode: each decode step is launched before the previous one's tokens are read, its
    input ids fed on the device. Greedy output equals step-by-step decoding for sequences that end
    at different lengths, on a stop string and on EOS; a sequence ending leaves the step launched
    for it unused, and the batch goes on."""
    target = hf_models["qwen3"]
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:4])]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 14, 20)]
    want = [o.outputs[0].token_ids for o in
            static_graph_llm(target, async_decode=False).generate(prompts, params, use_tqdm=False)]
    llm = static_graph_llm(target, async_decode=True)
    counts = count_ahead(llm.engine, monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert counts["used"] > 10 and counts["launched"] > counts["used"]  # endings left launched steps unused
    assert llm.engine.step_counts["overlapped"] == counts["used"] and llm.engine.step_counts["unused ahead"] > 0
    stop = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)  # EOS allowed
    plain = static_graph_llm(target, async_decode=False).generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert stop[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_overlapped_decoding_lets_new_requests_join(hf_models, monkeypatch):
    """A request arriving mid-stream: the step launched ahead for the old batch goes unused (nothing
    is launched ahead while one waits), the prompt is prefilled and both decode on, as step by step."""
    target = hf_models["qwen3"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(async_decode: bool):
        engine = static_graph_llm(target, async_decode=async_decode).engine
        counts = count_ahead(engine, monkeypatch) if async_decode else None
        engine.add_request("a", {"prompt_token_ids": list(range(3, 14))}, params)
        outs, step = {}, 0
        while engine.has_unfinished():
            if step == 5:
                engine.add_request("b", {"prompt_token_ids": list(range(40, 47))}, params)
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            step += 1
        return outs, counts

    want, _ = run(False)
    got, counts = run(True)
    assert got == want and counts["used"] > 5


def test_overlapped_sampling_in_the_graph_keeps_its_lengths(hf_models, monkeypatch):
    target = hf_models["qwen3"]
    llm = static_graph_llm(target, async_decode=True)
    counts = count_ahead(llm.engine, monkeypatch)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 15))}] * 3,
                        SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 3 and counts["used"] > 5
    vocab = llm.engine.model.config.vocab_size
    assert all(0 <= t < vocab for o in outs for t in o.outputs[0].token_ids)



def test_a_dormant_drafters_plain_steps_are_launched_ahead(hf_models, tmp_path, monkeypatch):
    """Overlapped decoding with a speculator: while its policy is in a run of plain steps (the
    drafter dormant: plain steps capture no taps), each plain step is launched before the previous
    one's tokens are read, and the speculator is not even consulted for the run's steps; never the
    step before a draft, which needs the new tokens. Greedy output equals plain decoding and the
    drafts equal those of an engine that waits (and consults the speculator every step)."""
    from tests.spec_fixtures import write_dflash_drafter
    target, every = hf_models["qwen3"], 6
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:4])]
    plain = [o.outputs[0].token_ids for o in
             static_graph_llm(target, async_decode=False).generate(prompts, GREEDY, use_tqdm=False)]
    spec = {"method": "dflash", "model": str(write_dflash_drafter(target, tmp_path / "dflash")), "adaptive": False}

    def run(async_decode: bool):
        llm = static_graph_llm(target, speculative_config=spec, async_decode=async_decode)
        engine, speculator = llm.engine, llm.engine.speculator
        drafts, pending, proposes = [], [], []
        choose, propose, advance_plain = speculator._choose, speculator.proposer.propose, speculator.policy.advance_plain
        made = [0]  # choices made so far, evaluated or counted in a promised run

        def choose_every(*args):  # a draft every `every` decode steps, plain decoding between
            made[0] += 1
            return choose(*args) if (made[0] - 1) % every == 0 else 0

        def advance(steps=1):  # a promised run: choices of plain decoding made without evaluating
            made[0] += steps
            advance_plain(steps)

        def record(seqs, ks):
            pending.append(engine.overlap.ahead is not None)  # a step launched ahead of this drafted one
            return [drafts.append(d.tokens) or d for d in propose(seqs, ks)]
        monkeypatch.setattr(speculator, "_choose", choose_every)
        monkeypatch.setattr(speculator.policy, "plain_run", lambda: (every - made[0] % every) % every)
        monkeypatch.setattr(speculator.policy, "advance_plain", advance)
        monkeypatch.setattr(speculator.proposer, "propose", record)
        monkeypatch.setattr(speculator, "choose", lambda running, f=speculator.choose: proposes.append(1) or f(running))
        counts = count_ahead(engine, monkeypatch)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], drafts, pending, counts, len(proposes)

    waited, waited_drafts, _, _, waited_proposes = run(False)
    got, drafts, pending, counts, proposes = run(True)
    assert got == waited == plain
    assert drafts == waited_drafts and len(drafts) > 4 and not any(pending)
    assert counts["used"] > 10
    assert proposes == waited_proposes - counts["used"]  # no overlapped step consulted the speculator


def test_steps_after_an_empty_lookup_are_launched_ahead(hf_models, monkeypatch):
    """An n-gram speculator whose lookup finds nothing guesses the next step plain and launches it
    ahead, though its policy wants to draft (here: always); the next step asks again, and a match
    then drafts, the launched step going unused. Greedy output equals plain decoding."""
    import itertools
    target = hf_models["qwen3"]
    prompt = {"prompt_token_ids": [(7 * j) % 290 + 3 for j in range(40)]}
    want = static_graph_llm(target, async_decode=False).generate(prompt, GREEDY, use_tqdm=False)[0]
    llm = static_graph_llm(target, speculative_config={"method": "ngram", "adaptive": False})
    proposer, calls = llm.engine.speculator.proposer, itertools.count()
    lookup = proposer.lookup
    monkeypatch.setattr(proposer, "lookup", lambda seq, k: lookup(seq, k) if next(calls) % 4 == 3 else [])
    counts = count_ahead(llm.engine, monkeypatch)
    got = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.metrics.num_drafts > 0 and counts["used"] > 5 and counts["launched"] > counts["used"]


# ----------------------------------------------------------------------------- real graphs (GPU)

@gpu
@pytest.mark.parametrize("q_lens", [[1], [1] * 3, [1] * 8, [1] * 17, [4], [4, 4], [4] * 5, [2, 4, 3]],
                         ids=lambda q: f"{len(q)}x{max(q)}" + ("-ragged" if len(set(q)) > 1 else ""))
def test_graph_replay_matches_eager_logits(q_lens):
    settings = GraphSettings(64, max_batch=32, query_lens=(1, 4))
    runner, tables, lens = prefilled(tiny_model("cuda"), settings, len(q_lens))
    args = (step_tokens(q_lens), lens, tables)
    padded_eagerly = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block, replace(settings, capture=False))
    for capture in ((), (0, 1)):
        results = [r(StepPlan.forward(*args, all_logits=True, capture_layers=capture))
                   for r in (runner.run, padded_eagerly.run, runner.run_eager)]
        fields = ("logits", "features") if capture else ("logits",)  # logits only: compare them alone
        for g, s, w in ([getattr(r, f) for r in results] for f in fields):
            assert rel_err(g, s) <= 1e-6  # the graph replays exactly the padded batch
            assert rel_err(g, w) <= 1e-4  # which computes the eager step (other kernel shapes: rounding)
    graph, _ = runner.graphs.graphs[runner.graphs.bucket(*args) + ((0, 1), False, False, False, False)]
    assert graph is not None


@gpu
def test_a_capture_survives_the_collector_freeing_old_graphs(monkeypatch):
    """Graphs of a dropped runner, kept alive only by a reference cycle, must not be destroyed by a
    collection during the next capture (that invalidates it): the collector waits until it is done."""
    import gc
    settings = GraphSettings(64, max_batch=2, query_lens=(1,))
    model = tiny_model("cuda")
    old, _, _ = prefilled(model, settings, 2)
    old.capture_graphs()
    assert any(graph is not None for graph, _ in old.graphs.graphs.values())
    forward, thresholds = CudaGraphRunner._forward, gc.get_threshold()

    def collecting_often(self, *args):  # inside a capture, a full collection at nearly every allocation
        if torch.cuda.is_current_stream_capturing():
            gc.set_threshold(1, 1, 1)
        try:
            return forward(self, *args)
        finally:
            gc.set_threshold(*thresholds)
    monkeypatch.setattr(CudaGraphRunner, "_forward", collecting_often)
    gc.disable()  # until the capture: the cycle stays uncollected
    try:
        old.cycle = old
        del old
        runner, tables, lens = prefilled(model, settings, 2)
    finally:
        gc.enable()
    runner.capture_graphs()
    args = (step_tokens([1, 1]), lens, tables)
    assert rel_err(runner.forward(*args), runner.run_eager(StepPlan.forward(*args)).logits) <= 1e-4
    assert gc.isenabled()


@gpu
def test_graphs_captured_at_engine_start_record_inference_kernels(hf_models, tmp_path, monkeypatch):
    """Captured outside inference mode, the model's ops would take their autograd-safe torch
    references (and record autograd state) into every graph: 2.5x slower replays, other numerics."""
    from tests.spec_fixtures import write_dflash_drafter
    seen = []
    forward = CudaGraphRunner._forward
    monkeypatch.setattr(CudaGraphRunner, "_forward",
                        lambda self, *args: seen.append(torch.is_inference_mode_enabled()) or forward(self, *args))
    spec = {"method": "dflash", "model": str(write_dflash_drafter(hf_models["qwen3"], tmp_path / "d"))}
    llm = LLM(str(hf_models["qwen3"]), device="cuda", kv_cache_memory=16 << 20, speculative_config=spec)
    assert len(seen) >= 2 * len(llm.engine.runner.graphs.graphs) and all(seen)  # warm-up and capture of each
    assert llm.engine.speculator.proposer.graphs.graphs  # the drafter's too, without a device assert


@gpu
def test_a_graph_step_never_syncs_with_the_host():
    settings = GraphSettings(64, max_batch=8, query_lens=(1,))
    runner, tables, lens = prefilled(tiny_model("cuda"), settings, 3)
    runner.forward(step_tokens([1, 1, 1]), lens, tables)  # captures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.forward(step_tokens([1, 1, 1]), [n + 1 for n in lens], tables)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.graphs.replays[(4, 1)] == 2


@gpu
@pytest.mark.parametrize("cache_type", ["bf16", "q8_0"])
def test_graph_replay_in_bfloat16_with_quantised_kv_is_close_to_eager(cache_type):
    settings = GraphSettings(64, max_batch=8, query_lens=(1, 4))
    kv = {"cache_type_k": cache_type, "cache_type_v": cache_type}
    runner, tables, lens = prefilled(tiny_model("cuda", torch.bfloat16), settings, 5, **kv)
    for q_lens in ([1] * 5, [4, 3, 4, 2, 4]):
        args = (step_tokens(q_lens), lens, tables)
        assert rel_err(runner.forward(*args, all_logits=True),
                       runner.run_eager(StepPlan.forward(*args, all_logits=True)).logits) <= 3e-2


@gpu
@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0"])
def test_graph_replay_of_quantised_weights_on_int8_activations_equals_eager(quant):
    """Quantised weights as the engine lays them out (q and k fused when v differs, split rows): the
    int8 paths inside graphs (rows rounded by RMSNorm / silu * up or a quantising launch, dp4a GEMVs,
    int8 verify tiles) compute what they compute eagerly, decode and verify."""
    from lucebox.bench.shapes import build_random_model
    from lucebox.kernels.linear import takes_int8
    model = build_random_model("tiny", quant, "cuda").model
    model.fuse_projections()
    model.split_quant_rows()
    attn = model.layers[0].self_attn
    row = torch.zeros(1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    if quant == "q4_k_m":  # decode on int8: q and k fused (v in Q6_K), their input rounded by the norm
        assert attn.qk is not None and takes_int8((attn.qk,), row)
    else:  # verify on int8 (split Q8_0 rows), decode on the float GEMV
        assert attn.qkv is not None and takes_int8((attn.qkv,), row.repeat(4, 1)) and not takes_int8((attn.qkv,), row)
    settings = GraphSettings(64, max_batch=4, query_lens=(1, 4))
    runner, tables, lens = prefilled(model, settings, 3)
    for q_lens in ([1] * 3, [4, 3, 4]):
        args = (step_tokens(q_lens), lens, tables)
        assert rel_err(runner.forward(*args, all_logits=True),
                       runner.run_eager(StepPlan.forward(*args, all_logits=True)).logits) <= 1e-5


@gpu
@pytest.mark.parametrize("method", ["plain", "self_draft", "dflash"])
def test_greedy_generation_is_identical_with_and_without_graphs(method, hf_models, tmp_path):
    from tests.spec_fixtures import write_dflash_drafter
    target = hf_models["qwen3"]
    config = {"plain": None,
              "self_draft": {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
              "dflash": {"method": "dflash", "model": str(write_dflash_drafter(target, tmp_path / "d"))}}[method]
    if config is not None:
        config["adaptive"] = False
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:6])]
    outputs = []
    for eager in (True, False):
        # A fixed KV budget: by default the pool takes 90% of the GPU, and two engines overlap here.
        llm = LLM(str(target), device="cuda", dtype="float32", block_size=BLOCK, cuda_graphs=not eager,
                  speculative_config=config, kv_cache_memory=64 << 20)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        if graphs is not None:
            assert sum(graphs.replays.values()) > 0 and any(g is not None for g, _ in graphs.graphs.values())
        del llm, graphs
    assert outputs[0] == outputs[1]


@gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_decoding_through_real_graphs(hf_models, monkeypatch, temperature):
    """async_decode with captured graphs, pinned copies and events: greedy output equals step-by-step
    decoding (sequences ending at different lengths); sampled output keeps its lengths; most steps
    were launched ahead and used."""
    target = hf_models["qwen3"]
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(n)]} for i, n in enumerate(PROMPT_LENS[:4])]
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in (3, 9, 14, 20)]
    outputs = []
    for overlap in (False, True):
        llm = LLM(str(target), device="cuda", dtype="float32", block_size=BLOCK, kv_cache_memory=64 << 20,
                  async_decode=overlap)
        counts = count_ahead(llm.engine, monkeypatch) if overlap else None
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert [len(t) for t in outputs[1]] == [3, 9, 14, 20] and counts["used"] > 10
    if temperature == 0:
        assert outputs[1] == outputs[0]


def test_cuda_graphs_are_on_by_default_for_cuda_only_and_enforce_eager_turns_them_off(hf_models):
    from lucebox.cli import build_parser
    target = str(hf_models["qwen3"])
    assert LLM(target, device="cpu").engine._graph_settings() is None  # CPU default: eager
    assert LLM(target, device="cpu", cuda_graphs=True).engine._graph_settings() is not None
    assert LLM(target, device="cpu", cuda_graphs=True, enforce_eager=True).args.cuda_graphs is False
    parser = build_parser()
    assert parser.parse_args(["generate", "--enforce-eager"]).cuda_graphs is False
    assert parser.parse_args(["generate"]).cuda_graphs is None
    assert parser.parse_args(["generate"]).async_decode is True  # overlapped decoding: on by default
    assert parser.parse_args(["serve", "--no-async-decode"]).async_decode is False
    if torch.cuda.is_available():
        assert LLM(target, device="cuda").engine._graph_settings() is not None


@gpu
def test_sampling_with_every_processor_never_syncs_with_the_host():
    """Per-request parameters reach the device through pinned, asynchronous copies: a plain
    torch.tensor(..., device="cuda") would wait for the queued forward before the sampling
    kernels could even be launched (the host and GPU would take turns at temperature > 0)."""
    from lucebox.sampling.sampler import Sampler, SamplingState
    logits = torch.randn(3, 50, device="cuda")
    params = [SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, seed=1),
              SamplingParams(temperature=1.3, repetition_penalty=1.2, presence_penalty=0.5, logit_bias={3: 2.0}),
              SamplingParams(temperature=0)]
    states = [SamplingState.create(p, [1, 2, 3], "cuda", i) for i, p in enumerate(params)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = Sampler([0])(logits, states).sampled_token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (3,) and int(tokens[2]) == int(logits[2].argmax())


@gpu
def test_an_eager_batch_reaches_the_device_without_a_sync():
    """Pinned, asynchronous copies: a pageable torch.tensor(..., device="cuda") would wait for every
    queued kernel first (the previous step's forward)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = ForwardBatch.build([[1, 2, 3], [4]], [0, 7], [[0], [1]], 16, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch.slot_mapping.tolist() == [0, 1, 2, 23]


# ----------------------------------------------------------------------------- sampling inside the graph

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_decode_graphs_that_sample_draw_from_the_samplers_distribution(device):
    """sampling.acceptance.accept_in_graph through the padded static decode batch: each row's tokens follow
    the distribution `Sampler.processed_probs` gives for its parameters (Pearson, p = 1e-3), and a
    greedy row in the same batch takes the argmax."""
    from collections import Counter

    from lucebox.sampling.sampler import Sampler, SamplingState

    from tests.spec.test_spec import chi_square_rejects
    settings = GraphSettings(64, max_batch=4, query_lens=(1,), capture=device == "cuda", sample=True)
    runner, tables, lens = prefilled(tiny_model(device), settings, 3)
    # Low temperatures: this model's logits span only 1-2.4, so at T = 1 every row is nearly uniform.
    params = [SamplingParams(temperature=0.3, top_k=12, top_p=0.9, min_p=0.02), SamplingParams(temperature=0.2),
              SamplingParams(temperature=0)]
    args = (step_tokens([1, 1, 1]), lens, tables)
    vocab = runner.model.config.vocab_size
    want = Sampler().processed_probs(runner.run_eager(StepPlan.forward(*args)).logits,
                                     [SamplingState(p, []) for p in params])
    n, counts = 3000, [Counter() for _ in params]
    for _ in range(n):
        result = runner.run(StepPlan.forward(*args, sample=[graph_row(p, vocab) for p in params]))
        assert result.logits is None and result.tokens is None
        for row, (accepted, token) in enumerate(result.verdicts):
            assert accepted == 0  # a decode has no drafts
            counts[row][token] += 1
    assert sum(runner.graphs.replays.values()) == n
    assert all((graph is not None) == (device == "cuda") for graph, _ in runner.graphs.graphs.values())
    for row in range(2):
        probs = {t: p for t, p in enumerate(want[row].tolist()) if p > 0}
        assert set(counts[row]) <= set(probs)  # filtered tokens never drawn
        rejects, stat, critical = chi_square_rejects(counts[row], probs, n)
        assert not rejects, (row, stat, critical)
    assert set(counts[2]) == {int(want[2].argmax())}
    assert len(counts[0]) < len(counts[1])  # the filters of row 0 bite


def test_graph_sampling_takes_only_rows_of_simple_parameters():
    assert graph_samplable(SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.1), 0)
    assert graph_samplable(SamplingParams(temperature=0), 0)
    for special in (dict(seed=3), dict(logprobs=1), dict(repetition_penalty=1.2), dict(logit_bias={1: 1.0}),
                    dict(min_tokens=2)):
        assert not graph_samplable(SamplingParams(temperature=0.8, **special), 0)
    assert graph_row(SamplingParams(temperature=0.8, top_k=0, top_p=1.0), 96) == (0.8, 96, 2.0, 0.0, False)


def test_the_engine_samples_plain_decode_steps_in_the_graph(hf_models):
    """Unseeded sampled decodes take the sampling graphs; a seeded request keeps its own generator
    (reproducible whatever the batch), so its steps sample on the host."""
    llm = LLM(str(hf_models["qwen3"]), device="cpu", block_size=BLOCK, cuda_graphs=True)
    runner = llm.engine.runner
    settings = replace(llm.engine._graph_settings(), capture=False)
    assert settings.sample
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block, settings)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    out = llm.generate(prompt, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    sampled = [key for key in runner.graphs.graphs if key[3]]
    assert sampled
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=7)
    runs = [llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_the_engine_accepts_n_gram_drafts_in_the_graph(hf_models):
    """With n-gram speculation, verify steps of sampled and greedy rows take the
    sampling graphs of their draft width (accept_in_graph), and the greedy request's output is
    token-identical to plain greedy decoding while its drafts are accepted."""
    path = str(hf_models["qwen3"])
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9] * 4}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = LLM(path, device="cpu", block_size=BLOCK).generate(prompt, greedy, use_tqdm=False)[0]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "adaptive": False}
    llm = LLM(path, device="cpu", block_size=BLOCK, cuda_graphs=True, speculative_config=spec)
    runner = llm.engine.runner
    runner.graphs = CudaGraphRunner(runner.model, BLOCK, runner.scratch_block,
                                    replace(llm.engine._graph_settings(), capture=False))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt, prompt], [greedy, sampled], use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference.outputs[0].token_ids
    assert out[0].metrics.num_accepted_tokens > 0
    assert len(out[1].outputs[0].token_ids) == 12
    assert any(q > 1 and in_graph for _, q, _, in_graph, *_ in runner.graphs.graphs)


# ----------------------------------------------------------------------------- programmatic dependent launch

def test_every_kernel_that_may_start_early_waits_for_the_previous_one_first():
    """dispatch.pdl_launch lets a kernel start while the one before it drains; that is safe only if
    the kernel waits for the previous kernel's writes before it reads or writes anything: every
    Triton kernel taking PDL makes wait_for_previous_kernel(PDL) its first statement, and every
    launch passing pdl_launch's options goes to such a kernel."""
    import ast
    from pathlib import Path

    import lucebox.kernels
    kernels_dir = Path(lucebox.kernels.__file__).parent
    with_pdl, launches = set(), 0
    for path in sorted(kernels_dir.glob("triton_*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and "PDL" in [a.arg for a in fn.args.args]:
                body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                if fn.name != "wait_for_previous_kernel":
                    assert ast.unparse(body[0]) == "wait_for_previous_kernel(PDL)", f"{path.name}:{fn.name}"
                    with_pdl.add(fn.name)
            spread = [ast.unparse(k.value) for k in getattr(fn, "keywords", ()) if k.arg is None]
            if isinstance(fn, ast.Call) and any(s.startswith("pdl_launch(") for s in spread):
                launches += 1
                launched = ast.unparse(fn.func.value if isinstance(fn.func, ast.Subscript) else fn.func)
                known = {"_kernel()", "chunk_kernel", "row_kernel", "first_rejection", "kernel"} | with_pdl
                assert launched in known, f"{path.name}: {launched} launched with pdl_launch"
    assert len(with_pdl) >= 13 and launches >= 13


def test_pdl_is_off_for_the_cpu_for_verify_tiles_and_when_the_environment_says_so(monkeypatch):
    from lucebox.kernels.dispatch import pdl_launch
    assert pdl_launch(torch.device("cpu")) == {}
    monkeypatch.delenv("LUCEBOX_PDL_TILES", raising=False)
    assert pdl_launch(torch.device("cuda"), tiles=True) == {}  # quantised verify tiles: slower with it
    monkeypatch.setenv("LUCEBOX_PDL", "0")
    assert pdl_launch(torch.device("cuda")) == {}


@gpu
def test_graphs_launched_with_pdl_compute_bit_for_bit_what_graphs_without_it_do(monkeypatch):
    """A race between overlapping kernels (one reading what the previous one has not yet written)
    would change logits: decode steps replayed many times with PDL equal those without it."""
    from lucebox.kernels.dispatch import pdl_launch
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    assert pdl_launch(torch.device("cuda"))["launch_pdl"]
    settings = GraphSettings(64, max_batch=32, query_lens=(1, 4))
    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("LUCEBOX_PDL", pdl)
        runner, tables, lens = prefilled(tiny_model("cuda", torch.bfloat16), settings, 8, room=28)
        results[pdl] = [runner.forward(step_tokens([1] * 8 if step % 2 else [4] * 8), [n + 4 * step for n in lens],
                                       tables, all_logits=True).clone()  # a graph's output buffer is reused
                        for step in range(6) for _ in range(3)]
    assert len(results["1"]) == 18
    for got, want in zip(results["1"], results["0"]):
        assert torch.equal(got, want)
