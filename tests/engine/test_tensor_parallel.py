"""Tensor parallelism over two gloo processes on this machine: TP=2 computes what TP=1 computes.

Each engine here starts a real second rank (`python -m lucebox.engine.tensor_parallel`) and shuts it
down again; float32 logits agree within reduction-order error, greedy tokens exactly, with and without
speculation (n-gram, DFlash on rank 0)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from lucebox import LLM, SamplingParams
from lucebox.convert import convert_hf_to_gguf
from lucebox.engine.step_plan import PlanRow, StepPlan
from lucebox.engine.tp_plan import (
    pack_compaction,
    pack_plan,
    unpack_compaction,
    unpack_plan,
)
from lucebox.engine.tp_ranks import TensorParallelError
from lucebox.errors import UnsupportedError
from lucebox.weights.quant import QuantEmbedding, QuantLinear, QuantTensor
from tests.conftest import build_hf_model
from tests.model.test_gguf import random_blocks, rewrite_gguf
from tests.model.test_laguna import build_laguna
from tests.spec.test_ddtree_engine import CompactionSpy
from tests.spec.test_spec import small_pair  # noqa: F401
from tests.spec_fixtures import write_dflash_drafter

PROMPTS = ["def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine_kwargs(**extra) -> dict:
    return {"max_model_len": 128, "max_num_seqs": 4, "kv_cache_memory": 8 << 20} | extra


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one bare forward (the last blocks of each KV cache group's pool)."""
    runner = llm.engine.runner
    blocks = -(-len(ids) // runner.block_size)
    table, *windows = [list(range(pool - blocks, pool)) for pool in (runner.num_blocks, *runner.group_scratch)]
    return runner.forward([ids], [0], [table], window_tables=[windows], all_logits=True)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def reference(model: str) -> tuple[torch.Tensor, list[list[int]], list[int]]:
    llm = LLM(model, speculative_config={}, **engine_kwargs())
    ids = llm.tokenizer.encode(PROMPTS[0])
    return all_logits(llm, ids), greedy_tokens(llm), ids


def assert_tp2_matches(model: str, speculative_config: dict) -> LLM:
    logits, tokens, ids = reference(model)
    llm = LLM(model, speculative_config=speculative_config, tensor_parallel_size=2, **engine_kwargs())
    try:
        cfg, attn = llm.engine.loaded.config, llm.engine.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (cfg.num_heads // 2, max(1, cfg.num_kv_heads // 2))  # a shard
        got = all_logits(llm, ids)
        assert got.shape == logits.shape
        assert (got - logits).abs().max().item() <= 1e-4
        assert greedy_tokens(llm) == tokens
        if speculative_config:
            assert llm.engine.step_counts["verify"] > 0  # drafts were verified under TP
    finally:
        llm.engine.shutdown()
    return llm


@pytest.fixture(scope="module")
def kquant_gguf(tokenizer_dir, tmp_path_factory) -> Path:
    """A llama whose matrices are Q4_K / Q6_K (256-value blocks): each rank's K share is 256 wide."""
    tmp = tmp_path_factory.mktemp("kquant")
    hf_dir = build_hf_model("llama", tmp / "hf", tokenizer_dir, hidden_size=512, intermediate_size=512,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return k_quantised(convert_hf_to_gguf(hf_dir, tmp / "f32.gguf", "f32"), tmp / "q4k.gguf")


def k_quantised(f32: Path, out: Path) -> Path:
    kinds = {"token_embd.weight": Q.Q6_K, "output.weight": Q.Q6_K, "blk.0.attn_q.weight": Q.Q4_K,
             "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.attn_output.weight": Q.Q4_K,
             "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q4_K, "blk.0.ffn_down.weight": Q.Q6_K}
    rng = np.random.default_rng(0)
    replaced = {}
    for t in GGUFReader(f32).tensors:
        if t.name in kinds:
            rows, cols = reversed(t.shape.tolist())
            replaced[t.name] = (random_blocks(kinds[t.name], rows, cols, rng), kinds[t.name])
    return rewrite_gguf(f32, out, tensors=replaced)


# ---------------------------------------------------------------------------------------- same output

def test_llama_tp2_equals_tp1_with_ngram_speculation(hf_models):
    assert_tp2_matches(str(hf_models["llama"]), {"method": "ngram", "num_speculative_tokens": 3})


def test_prefix_cache_hits_reuse_every_ranks_kv(hf_models):
    _, tokens, _ = reference(str(hf_models["llama"]))
    llm = LLM(str(hf_models["llama"]), speculative_config={}, tensor_parallel_size=2, **engine_kwargs())
    try:
        assert greedy_tokens(llm) == tokens
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the prompts' full blocks come from the cache
        assert all(out.num_cached_tokens > 0 for out in again)
        assert [out.outputs[0].token_ids for out in again] == tokens
    finally:
        llm.engine.shutdown()


def test_qwen3_tied_head_tp2_equals_tp1_with_dflash_on_rank0(hf_models, tmp_path):
    target = hf_models["qwen3"]
    drafter = write_dflash_drafter(target, tmp_path / "dflash", taps=(0, 1), block_size=4)
    assert_tp2_matches(str(target), {"method": "dflash", "model": str(drafter)})


def test_dflash_trees_compact_every_ranks_kv_and_stay_token_identical(small_pair, tmp_path):
    # the 7-token peaked target: trees accept off the top-1 chain, so accepted rows move on each rank's
    # KV (compact_tree_rows, broadcast); 7 rows over 2 ranks also pads the last vocabulary shard
    target, _ = small_pair
    drafter = write_dflash_drafter(target, tmp_path / "dflash", block_size=4)
    prompts = [{"prompt_token_ids": [i % 6, (i * 5) % 6, 3, (i + 2) % 6]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(target), block_size=4).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(target), block_size=4, tensor_parallel_size=2,
              speculative_config={"method": "dflash", "model": str(drafter), "tree_budget": 12, "adaptive": False})
    try:
        spy = CompactionSpy(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
        assert spy.moved > 0
    finally:
        llm.engine.shutdown()


def test_llama_tp2_equals_tp1_with_a_draft_model_on_rank0(hf_models):
    assert_tp2_matches(str(hf_models["llama"]), {"method": "draft_model", "model": str(hf_models["llama"]),
                                                 "num_speculative_tokens": 3})


def test_one_kv_head_is_replicated_on_both_ranks(tokenizer_dir, tmp_path):
    # multi-query attention: each rank keeps the one KV head and half the query heads
    hf_dir = build_hf_model("llama", tmp_path / "mqa", tokenizer_dir, num_key_value_heads=1)
    assert_tp2_matches(str(hf_dir), {"method": "ngram", "num_speculative_tokens": 3})


def test_llama_biases_tp2_equals_tp1_plainly(hf_models):
    # attention and MLP biases: a row-parallel bias is added once, after the all-reduce
    assert_tp2_matches(str(hf_models["llama-linear-bias"]), {})


def test_q8_0_gguf_tp2_equals_tp1_with_ngram_speculation(hf_models, tmp_path):
    path = convert_hf_to_gguf(hf_models["qwen2"], tmp_path / "q8.gguf", "q8_0")
    assert_tp2_matches(str(path), {"method": "ngram", "num_speculative_tokens": 3})


def test_q4_k_gguf_tp2_equals_tp1_with_ngram_speculation(kquant_gguf):
    assert_tp2_matches(str(kquant_gguf), {"method": "ngram", "num_speculative_tokens": 3})


def test_quantised_shards_stay_quantised_in_whole_blocks(kquant_gguf):
    llm = LLM(str(kquant_gguf), speculative_config={}, tensor_parallel_size=2, **engine_kwargs())
    try:
        layer = llm.engine.model.layers[0]
        o_proj, down = layer.self_attn.o_proj.local, layer.mlp.down_proj.local
        assert isinstance(o_proj, QuantLinear) and (o_proj.out_features, o_proj.in_features) == (512, 256)
        assert o_proj.qtype == Q.Q4_K and o_proj.qweight.shape == (512, 256 // 256 * 144)
        assert isinstance(down, QuantLinear) and down.qtype == Q.Q6_K and down.in_features == 256
        assert isinstance(llm.engine.model.embed_tokens.table, QuantEmbedding)
    finally:
        llm.engine.shutdown()


def test_qwen3_moe_experts_split_by_intermediate_width_tp2_equals_tp1(tokenizer_dir, tmp_path):
    # 8 experts of width 32: 16 a rank; the dense first layer (mlp_only_layers) splits as before
    hf_dir = build_hf_model("qwen3_moe", tmp_path / "moe", tokenizer_dir)
    assert_tp2_matches(str(hf_dir), {"method": "ngram", "num_speculative_tokens": 3})


def test_q8_0_qwen3moe_gguf_experts_stay_quantised_and_tp2_equals_tp1(tokenizer_dir, tmp_path):
    # expert width 64: 32 a rank, one Q8_0 block of each expert's down rows
    hf_dir = build_hf_model("qwen3_moe", tmp_path / "moe", tokenizer_dir, moe_intermediate_size=64)
    path = convert_hf_to_gguf(hf_dir, tmp_path / "moe-q8.gguf", "q8_0")
    llm = assert_tp2_matches(str(path), {})
    experts = llm.engine.model.layers[1].mlp.moe.experts
    assert isinstance(experts.down_proj, QuantTensor) and experts.down_proj.shape == (8, 64, 32)
    assert experts.gate_up_proj.shape == (8, 64, 64)


# ------------------------------------------------------------------------------------- clear refusals

def test_three_ranks_over_two_kv_heads_are_refused(hf_models):
    with pytest.raises(UnsupportedError, match=r"--tensor-parallel-size 3 does not fit the model's 2 KV heads"):
        LLM(str(hf_models["llama"]), speculative_config={}, tensor_parallel_size=3, **engine_kwargs())


def test_a_k_shard_inside_a_quant_block_is_refused(tokenizer_dir, tmp_path):
    # o_proj's 256 input features over 2 ranks: 128 each, half a Q4_K block
    hf_dir = build_hf_model("llama", tmp_path / "hf", tokenizer_dir, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    path = k_quantised(convert_hf_to_gguf(hf_dir, tmp_path / "f32.gguf", "f32"), tmp_path / "q4k.gguf")
    with pytest.raises(UnsupportedError, match=r"blk\.0\.attn_output\.weight.*column 128, inside a 256-value"):
        LLM(str(path), speculative_config={}, tensor_parallel_size=2, **engine_kwargs())


def test_a_laguna_layer_whose_heads_do_not_split_is_refused_naming_it(tokenizer_dir, tmp_path):
    # query heads [4, 6, 2, 8] a layer: 4 ranks (each of the 2 KV heads kept by two) cannot split layer 1's 6
    hf_dir = build_laguna(tmp_path / "laguna", tokenizer_dir)
    with pytest.raises(UnsupportedError, match=re.escape("--tensor-parallel-size 4 does not divide the model's "
                                                         "num_attention_heads_per_layer[1] (6)")):
        LLM(str(hf_dir), speculative_config={}, tensor_parallel_size=4, **engine_kwargs())


# ------------------------------------------------------------------------------------------- failures

def test_a_killed_rank_fails_the_next_step_instead_of_hanging(hf_models):
    llm = LLM(str(hf_models["llama"]), speculative_config={}, tensor_parallel_size=2, **engine_kwargs())
    try:
        worker = llm.engine.ranks.procs[0]
        worker.kill()
        worker.wait()
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 10
        with pytest.raises(TensorParallelError):  # the engine stays failed
            llm.engine.runner.forward([[1, 2]], [0], [[0]])
    finally:
        llm.engine.shutdown()


def test_a_rank_dying_mid_step_fails_the_step(hf_models, monkeypatch):
    llm = LLM(str(hf_models["llama"]), speculative_config={}, tensor_parallel_size=2, **engine_kwargs())
    try:
        worker = llm.engine.ranks.procs[0]
        real_send = llm.engine.ranks.channel.send

        def send_then_kill(op, payload=None):  # the rank dies while rank 0 is inside the forward's collectives
            real_send(op, payload)
            worker.kill()
        monkeypatch.setattr(llm.engine.ranks.channel, "send", send_then_kill)
        with pytest.raises(TensorParallelError, match="rank 1 exited"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_a_rank_that_cannot_start_fails_the_launch_with_its_output(hf_models, tmp_path, monkeypatch):
    shim = tmp_path / "python"  # what a rank started with a broken interpreter or environment would do
    shim.write_text("#!/bin/sh\necho 'rank cannot start: no CUDA driver' >&2\nexit 3\n")
    shim.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(shim))
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 exited \(code 3\):\nrank cannot start: no CUDA driver"):
        LLM(str(hf_models["llama"]), speculative_config={}, tensor_parallel_size=2, **engine_kwargs())
    assert time.monotonic() - started < 10


def test_shutdown_after_an_interrupted_step_kills_the_other_ranks_at_once(hf_models, monkeypatch):
    from lucebox.engine.runner import ModelRunner
    llm = LLM(str(hf_models["llama"]), speculative_config={}, tensor_parallel_size=2, **engine_kwargs())
    worker = llm.engine.ranks.procs[0]

    def interrupted(self, plan):  # Ctrl-C on rank 0 after the plan went out: rank 1 waits in a collective
        raise KeyboardInterrupt
    monkeypatch.setattr(ModelRunner, "run_eager", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    started = time.monotonic()
    llm.engine.shutdown()
    assert worker.poll() is not None and time.monotonic() - started < 5


RANK0_SCRIPT = """
import sys, time
from lucebox import LLM
llm = LLM(sys.argv[1], speculative_config={}, tensor_parallel_size=2, max_model_len=128, kv_cache_memory=8 << 20)
print(llm.engine.ranks.procs[0].pid, flush=True)
time.sleep(600)
"""


def test_the_other_ranks_exit_when_rank_0_is_killed(hf_models, tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, str(hf_models["llama"])], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        worker_pid = int(rank0.stdout.readline())
        rank0.send_signal(signal.SIGKILL)
        rank0.wait()
        deadline = time.monotonic() + 10
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker_pid), "rank 1 outlived rank 0"
    finally:
        rank0.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------------------- the packing

def test_a_plan_survives_packing_with_groups_trees_and_logits_rows():
    rows = [PlanRow([5, 6, 7], 10, [3, 4], window_tables=[[9], [8, 1]], parents=[-1, 0, 0]),
            PlanRow([1], 2, [0], window_tables=[[2], []], offset=3, index=1)]
    plan = StepPlan(rows, logits_rows=[0, 2, 3], write_kv=False)
    back = unpack_plan(pack_plan(plan))
    assert back.token_ids == plan.token_ids and back.start_positions == [10, 2]
    assert back.block_tables == plan.block_tables and back.group_tables == plan.group_tables
    assert [r.parents for r in back.rows] == [[-1, 0, 0], None] and [r.offset for r in back.rows] == [0, 3]
    assert back.logits_rows == [0, 2, 3] and not back.write_kv and not back.all_logits and back.graph_key is None
    key = (4, 4, (1, 3), True, False, False, False)  # CudaGraphRunner.key_for's: the graph rank 0 replays
    assert unpack_plan(pack_plan(plan, graph_key=key)).graph_key == key
    plain = unpack_plan(pack_plan(StepPlan.forward([[1, 2]], [0], [[0]], all_logits=True),
                                  graph_key=(1, 64, (), False, False, False, True)))
    assert plain.logits_rows is None and plain.all_logits and plain.write_kv and not plain.has_trees
    assert plain.graph_key == (1, 64, (), False, False, False, True)
    assert unpack_compaction(pack_compaction([[1, 2], [3]], [4, 5], [[0, 2], []])) == ([[1, 2], [3]], [4, 5],
                                                                                        [[0, 2], []], [])
    windows = [[[7], [8, 9]], [[], [6]]]  # per sequence, the tables of KV cache groups 1 and 2
    assert unpack_compaction(pack_compaction([[1, 2], [3]], [4, 5], [[0, 2], [0]], windows)) == (
        [[1, 2], [3]], [4, 5], [[0, 2], [0]], windows)


def test_engine_args_refuse_a_nonpositive_tensor_parallel_size():
    from lucebox.config import EngineArgs
    from lucebox.errors import RequestError
    with pytest.raises(RequestError, match="tensor_parallel_size must be a positive integer"):
        EngineArgs(tensor_parallel_size=0)


# -------------------------------------------------------------------------------------------- the faces

def test_cli_generate_with_two_ranks_prints_the_plain_greedy_text(hf_models, capsys):
    from lucebox.cli import main
    args = ["generate", "--model", str(hf_models["qwen3"]), "--prompt", "def", "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", "--max-model-len", "128"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == plain


def test_serve_with_two_ranks_answers_the_openai_sdk_and_stops_its_ranks(hf_models):
    import openai

    from tests.server_helpers import free_port, wait_until_healthy
    model = str(hf_models["qwen3"])
    expected = LLM(model, speculative_config={}, **engine_kwargs()).generate(
        "def fibonacci(n):", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lucebox.cli", "serve", "--model", model, "--port", str(port),
                             "--max-model-len", "128", "--tensor-parallel-size", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, 60, lambda: proc.stderr.read().decode())
        ranks = _children(proc.pid)
        assert len(ranks) == 1  # rank 1; rank 0 is the server itself
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected.outputs[0].text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert not any(_alive(pid) for pid in ranks)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(")")[-1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
