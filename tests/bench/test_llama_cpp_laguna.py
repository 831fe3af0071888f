"""The llama.cpp peer on the Laguna shapes: the random GGUF of `--shape laguna-xs-33b` (here its tiny twin) has
the names, shapes and metadata llama.cpp's laguna loader reads (tests/model/test_gguf_laguna.py holds them as
read in llama.cpp's sources), and llama-bench runs it where scripts/build_llama_cpp.sh built one."""
from __future__ import annotations

import subprocess

import pytest
from gguf import GGUFReader
from gguf import GGMLQuantizationType as Q

from lucebox.bench import llama_cpp, shapes
from tests.bench.test_llama_cpp import LLAMA_BENCH
from tests.model.test_gguf_laguna import llama_cpp_laguna_tensors


def laguna_names(cfg) -> dict[str, list[int]]:
    return llama_cpp_laguna_tensors(
        cfg.hidden_size, cfg.vocab_size, cfg.heads_per_layer, cfg.num_kv_heads, cfg.head_dim,
        (lambda n: n) if cfg.gate_per_head else (lambda n: n * cfg.head_dim), cfg.moe_layers.index(True),
        cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.intermediate_size,
        cfg.tie_word_embeddings)


@pytest.mark.parametrize("quant", ["bf16", "q4_k_m"])
def test_the_random_laguna_gguf_has_llama_cpps_names_shapes_and_keys(tmp_path, quant):
    cfg = shapes.shape_config("tiny-laguna")
    path = tmp_path / "laguna.gguf"
    assert llama_cpp.write_gguf(cfg, quant, path) == path.stat().st_size
    reader = GGUFReader(path)
    assert {t.name: t.shape.tolist() for t in reader.tensors} == laguna_names(cfg)
    types = {t.name: t.tensor_type for t in reader.tensors}
    big = Q.BF16 if quant == "bf16" else Q.Q4_K
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.attn_q.weight"] == big
    assert types["blk.1.ffn_gate_inp.weight"] == types["blk.1.exp_probs_b.bias"] == Q.F32
    assert sum(t.n_bytes for t in reader.tensors) == llama_cpp.expected_file_bytes(cfg, quant)
    a = "laguna."
    want = {a + "block_count": 4, a + "embedding_length": 256, a + "attention.head_count": [2, 4, 4, 4],
            a + "attention.head_count_kv": 1, a + "attention.key_length": 128, a + "attention.sliding_window": 64,
            a + "attention.sliding_window_pattern": [False, True, True, True], a + "rope.dimension_count": 64,
            a + "rope.dimension_count_swa": 128, a + "rope.freq_base": 5e5, a + "rope.freq_base_swa": 1e4,
            a + "leading_dense_block_count": 1, a + "expert_count": 8, a + "expert_used_count": 2,
            a + "expert_feed_forward_length": 256, a + "expert_shared_feed_forward_length": 256,
            a + "expert_weights_norm": True, a + "expert_weights_scale": 2.5, a + "expert_gating_func": 2,
            "tokenizer.ggml.pre": "laguna"}
    assert {key: reader.fields[key].contents() for key in want if key in reader.fields} == pytest.approx(want)


def test_every_tensor_of_laguna_xs_has_one_llama_cpp_name():
    cfg = shapes.shape_config("laguna-xs-33b")
    plan = llama_cpp.tensor_plan(cfg, "q4_k_m")
    names = [target for _, target, _, _ in plan]
    assert llama_cpp.arch_of(cfg) == "laguna" and len(names) == len(set(names))
    assert {target: list(reversed(shape)) for _, target, shape, _ in plan} == laguna_names(cfg)
    # ~33B weights at Q4_K_M's ~4.9 bits (the 8 x 256 experts of 512 are most of them)
    assert 18e9 < llama_cpp.expected_file_bytes(cfg, "q4_k_m") < 23e9


@pytest.mark.skipif(not LLAMA_BENCH.is_file(), reason="no .llama/bin/llama-bench (scripts/build_llama_cpp.sh)")
@pytest.mark.parametrize("quant", ["q4_k_m", "bf16"])
def test_llama_bench_loads_and_runs_the_random_laguna(tmp_path, quant):
    path = tmp_path / "laguna.gguf"
    llama_cpp.write_gguf(shapes.shape_config("tiny-laguna"), quant, path)
    # --repack 0: the CPU backend's AMX repacking crashes in VMs without AMX tile permission
    command = llama_cpp.bench_command(LLAMA_BENCH, path, [32], 8, [80], 1, ["--repack", "0", "-t", "1"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = llama_cpp.parse_bench_json(done.stdout)
    assert [(r["context"], r["tokens"]) for r in parsed["decode"]] == [(0, 8), (80, 8)]  # past the 64 window
    assert parsed["model_type"].startswith("laguna")
