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
from lucebox.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from lucebox.engine.graph_settings import GraphSettings, batch_buckets  # noqa: E402
from lucebox.engine.graph_io import StaticInputs  # noqa: E402
from lucebox.engine.runner import ModelRunner  # noqa: E402
from lucebox.engine.step_plan import StepPlan  # noqa: E402
from lucebox.kernels.forward_batch import ForwardBatch  # noqa: E402
from lucebox.model.config import ModelConfig  # noqa: E402
from lucebox.model.transformer import Transformer  # noqa: E402

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
