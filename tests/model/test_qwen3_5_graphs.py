"""Hybrid (Gated DeltaNet) decode and verify steps through CUDA-graph batches: the padded static
batches a graph replays (GraphSettings(capture=False) runs them eagerly, so this runs on the CPU)
compute the eager logits and leave the same recurrent state; the DeltaNet path of such a batch
never reads a device value on the host; end-to-end greedy output, plain and speculative, is the
eager one. Tests marked `gpu` capture real graphs and skip without CUDA."""
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
from lucebox.engine.graph_settings import GraphSettings  # noqa: E402
from lucebox.engine.step_plan import PlanRow, RowKind, StepPlan  # noqa: E402
from lucebox.model.deltanet import GatedDeltaNet  # noqa: E402
from lucebox.model.loader import load_model  # noqa: E402
from tests.conftest import build_hf_model  # noqa: E402
from tests.model.test_qwen3_5 import BLOCK_SIZE, HYBRID, prompts, runner_for  # noqa: E402
from tests.model.test_qwen3_5_spec import NGRAM, greedy, repetitive_prompts  # noqa: E402

gpu = pytest.mark.skipif(not ON_GPU, reason="captures CUDA graphs")


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_5_graphs"), tokenizer_dir, **HYBRID)


def mixed_step(loaded, device: str, capture: bool, fused: bool = False):
    """A runner with graph buckets (1 and 4 tokens) after prefilling 3 sequences, and a step of one
    decode row, a verify of 4 and a verify of 3 (padded to 4) in slots 2, 0, 3. fused: DeltaNet's
    input projections as one (strided views of its output reach the kernels)."""
    model = loaded.model.to(device)
    if fused:
        model.fuse_projections()
    runner, blocks = runner_for(loaded)
    layers = [model.layers[i].linear_attn for i in runner.recurrent_layers]
    runner.install_recurrent([layer.cache_spec().build(4, 4, device) for layer in layers], None)
    runner.attach_graphs(GraphSettings(64, max_batch=4, query_lens=(1, 4), capture=capture))
    vocab = loaded.config.vocab_size
    starts, slots = [7, 10, 5], [2, 0, 3]
    tables = []
    for n in starts:
        tables.append([])
        blocks.allocate(tables[-1], n + 4)
    runner.reset_states(slots)
    runner.run_eager(StepPlan.forward(prompts(vocab, starts, seed=3), [0] * 3, tables, state_slots=slots))
    new = prompts(vocab, [1, 4, 3], seed=4)
    kinds = [RowKind.DECODE, RowKind.VERIFY, RowKind.VERIFY]
    rows, offset = [], 0
    for i, (tokens, start, table, kind) in enumerate(zip(new, starts, tables, kinds)):
        rows.append(PlanRow(tokens, start, table, kind, offset=offset, index=i))
        offset += len(tokens)
    plan = StepPlan(rows, all_logits=True, state_slots=slots)
    return runner, plan, layers


def snapshot(layers):
    return [(layer.state.state.clone(), layer.state.conv.clone()) for layer in layers]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_a_padded_static_hybrid_step_gives_the_eager_logits_and_state(hybrid_path, device):
    """Graph buckets on the CPU are the padded static batches (capture=False); on CUDA, real graphs."""
    loaded = load_model(str(hybrid_path), dtype="float32", device=device)
    runner, plan, layers = mixed_step(loaded, device, capture=device == "cuda")
    before = snapshot(layers)
    want = runner.run_eager(plan).logits
    after_eager = snapshot(layers)
    for layer, (state, conv) in zip(layers, before):  # back to the state before the step
        layer.state.state.copy_(state)
        layer.state.conv.copy_(conv)
    got = runner.run(plan).logits
    assert runner.graphs.replays[(4, 4)] == 1
    assert (got - want).abs().max().item() <= 1e-4
    for layer, (state, conv), (eager_state, eager_conv) in zip(layers, before, after_eager):
        live = slice(0, 4)  # the scratch slot (4) holds padding's garbage
        assert (layer.state.state[live] - eager_state[live]).abs().max() <= 1e-5
        assert torch.equal(layer.state.conv[live], eager_conv[live])
        assert not torch.equal(eager_state[2], state[2])  # the decode row advanced its slot
        assert torch.equal(eager_state[0], state[0]) and torch.equal(eager_state[3], state[3])  # verifies did not


def test_a_padded_hybrid_step_through_triton_kernels_matches_the_torch_reference(hybrid_path, monkeypatch):
    """The whole hybrid on a device-only batch of decode + verify rows with Triton kernels
    (interpreted on the CPU): logits and the slots' states and windows."""
    pytest.importorskip("triton")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    device = "cuda" if ON_GPU else "cpu"
    loaded = load_model(str(hybrid_path), dtype="float32", device=device)
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    runner, plan, layers = mixed_step(loaded, device, capture=False, fused=True)
    assert all(layer.projections is not None for layer in (loaded.model.layers[i].linear_attn
                                                          for i in runner.recurrent_layers))
    before = snapshot(layers)
    want = runner.run_eager(plan).logits
    want_states = snapshot(layers)
    for layer, (state, conv) in zip(layers, before):
        layer.state.state.copy_(state)
        layer.state.conv.copy_(conv)
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got = runner.run(plan).logits
    assert runner.graphs.replays[(4, 4)] == 1
    assert (got - want).abs().max().item() <= 1e-4
    for layer, (state, conv) in zip(layers, want_states):
        assert (layer.state.state[:4] - state[:4]).abs().max() <= 1e-5
        assert (layer.state.conv[:4] - conv[:4]).abs().max() <= 1e-6


def test_the_deltanet_path_of_a_graph_batch_never_reads_device_values(hybrid_path, monkeypatch):
    """Inside every DeltaNet layer of a padded static step, no tensor value reaches the host (what
    would sync with the GPU, or break a capture): item / tolist / bool / int / float / numpy fail."""
    loaded = load_model(str(hybrid_path), dtype="float32")
    runner, plan, layers = mixed_step(loaded, "cpu", capture=False)
    inside = {"layers": 0}
    forward = GatedDeltaNet.forward

    def guarded(self, h, batch, rows=None):
        assert batch.device_only
        inside["layers"] += 1
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
                m.setattr(torch.Tensor, name, _refuse(name))
            return forward(self, h, batch, rows)

    monkeypatch.setattr(GatedDeltaNet, "forward", guarded)
    runner.run(plan)
    assert inside["layers"] == len(layers) and runner.graphs.replays[(4, 4)] == 1


def _refuse(name):
    def refuse(*_args, **_kwargs):
        raise AssertionError(f"Tensor.{name} read a device value on the host inside DeltaNet")
    return refuse


@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_greedy_generation_through_padded_static_batches_equals_eager(hybrid_path, config):
    """Decodes and verifies (with rejections) of a continuous batch through the static path."""
    # each engine's KV bounded: on a GPU the default pool takes most of the card, and both engines live at once
    eager = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_seqs=4, speculative_config=config,
                kv_cache_memory=64 << 20)
    batch = repetitive_prompts(eager.engine.loaded.config.vocab_size)
    want = [o.outputs[0].token_ids for o in greedy(eager, batch, 16)]
    llm = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_seqs=4, speculative_config=config, cuda_graphs=True,
              kv_cache_memory=64 << 20)
    runner = llm.engine.runner
    runner.attach_graphs(replace(llm.engine._graph_settings(), capture=False))
    assert [o.outputs[0].token_ids for o in greedy(llm, batch, 16)] == want
    replayed = runner.graphs.replays
    assert sum(n for (_, q), n in replayed.items() if q == 1) > 0
    if config is not None:
        assert sum(n for (_, q), n in replayed.items() if q > 1) > 0  # verifies took graph buckets
    assert len(llm.engine.scheduler.cache.free_slots) == 4


@gpu
@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_greedy_generation_is_identical_with_and_without_graphs(hybrid_path, config):
    outputs = []
    for graphs in (False, True):
        llm = LLM(str(hybrid_path), device="cuda", dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=4,
                  speculative_config=config, cuda_graphs=graphs, kv_cache_memory=64 << 20)
        batch = repetitive_prompts(llm.engine.loaded.config.vocab_size)
        outputs.append([o.outputs[0].token_ids for o in greedy(llm, batch, 24)])
        runner_graphs = llm.engine.runner.graphs
        assert (runner_graphs is not None) == graphs
        if graphs:
            assert sum(runner_graphs.replays.values()) > 0
        del llm, runner_graphs
    assert outputs[0] == outputs[1]


@gpu
def test_a_hybrid_graph_step_never_syncs_with_the_host(hybrid_path):
    loaded = load_model(str(hybrid_path), dtype="float32", device="cuda")
    runner, plan, _ = mixed_step(loaded, "cuda", capture=True)
    runner.run(plan)  # captures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.run(replace(plan, all_logits=False, logits_rows=None))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(runner.graphs.replays.values()) == 2


@gpu
def test_bfloat16_hybrid_prefill_and_decode_stay_close_to_float32(tmp_path, tokenizer_dir):
    """fla's chunked prefill (when installed) and the Triton steps in bfloat16 on the GPU track the
    float32 torch reference of the same weights on the CPU: a 150-token prefill, then 3 decodes.
    Head sizes fla takes (multiples of 16)."""
    hybrid_path = build_hf_model("qwen3", tmp_path / "m", tokenizer_dir,
                                 **{**HYBRID, "linear_key_head_dim": 16, "linear_value_head_dim": 32})
    vocab = load_model(str(hybrid_path), dtype="float32").config.vocab_size
    prompt, after = prompts(vocab, [150, 3], seed=8)
    logits = []
    for dtype, device in (("float32", "cpu"), ("bfloat16", "cuda")):
        runner, blocks = runner_for(load_model(str(hybrid_path), dtype=dtype, device=device))
        table = []
        blocks.allocate(table, len(prompt) + len(after))
        runner.reset_states([0])
        rows = [runner.forward([prompt], [0], [table], state_slots=[0])]
        for i, token in enumerate(after):
            rows.append(runner.forward([[token]], [len(prompt) + i], [table], state_slots=[0]))
        logits.append(torch.cat(rows).float().cpu())
    err = ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()).item()
    assert err <= 5e-2


def test_decoding_with_a_request_joining_mid_stream_equals_step_by_step(hybrid_path):
    """async_decode launches decode steps ahead; one that goes unused (a request joined) must not
    have advanced recurrent state, which, unlike K/V, a repeated step does not overwrite (it
    stashes its token, applied once it is used): after the step that prefills the newcomer, every
    slot holds what step-by-step decoding leaves."""
    def run(async_decode: bool):
        llm = LLM(str(hybrid_path), block_size=BLOCK_SIZE, max_num_seqs=4, cuda_graphs=True,
                  async_decode=async_decode)
        engine = llm.engine
        engine.runner.attach_graphs(replace(engine._graph_settings(), capture=False))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": list(range(3, 14))}, params)
        outs, step, states = {}, 0, None
        while engine.has_unfinished():
            if step == 5:
                engine.add_request("b", {"prompt_token_ids": list(range(40, 47))}, params)
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            if step == 5:  # a prefill step: nothing is launched ahead of it
                states = [s.state[:4].clone() for s in engine.runner.recurrent_states]
            step += 1
        return outs, states, engine.step_counts

    want, want_states, _ = run(False)
    got, got_states, counts = run(True)
    assert got == want
    assert counts["overlapped"] > 5 and counts["unused ahead"] > 0, counts  # used and unused steps launched ahead
    for a, b in zip(got_states, want_states):
        assert (a - b).abs().max() <= 1e-6
