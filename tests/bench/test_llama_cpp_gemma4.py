"""The llama.cpp peer's random GGUFs of the Gemma 4 shapes (gemma4-31b, gemma4-26b-a4b and their tiny twins):
llama.cpp's gemma4 names, shapes and metadata (src/models/gemma4.cpp's loader), the proportional RoPE's
rope_freqs, and a file lucebox itself loads as the model of that shape."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from lucebox.bench import llama_cpp, shapes
from lucebox.model.loader import load_model
from tests.bench.test_llama_cpp import LLAMA_BENCH, _arch_names, _field, _write
from tests.gguf_files import lucebox_logits


@pytest.mark.parametrize("shape", ["tiny-gemma4", "tiny-gemma4-moe"])
def test_random_gemma4_gguf_has_llama_cpp_s_names_shapes_and_metadata(tmp_path, shape):
    reader, cfg = _write(tmp_path, shape, "q4_k_m")
    tensors = {t.name: ([int(d) for d in t.shape], t.tensor_type) for t in reader.tensors}
    # gguf's GEMMA4 table, plus the router's two scales llama.cpp's converter writes as `.scale` tensors
    known = _arch_names("gemma4", cfg.num_layers) | {f"blk.{i}.{name}" for i in range(cfg.num_layers)
                                                     for name in ("ffn_gate_inp.scale", "ffn_down_exps.scale")}
    assert set(tensors) <= known
    h, full = cfg.hidden_size, cfg.layer_types.index("full_attention")
    assert tensors["blk.0.attn_q.weight"] == ([h, 2 * 128], Q.Q4_K) and "blk.0.attn_v.weight" in tensors
    assert tensors[f"blk.{full}.attn_q.weight"][0] == [h, 2 * 256] and f"blk.{full}.attn_v.weight" not in tensors
    assert tensors["token_embd.weight"] == ([h, cfg.vocab_size], Q.Q6_K) and "output.weight" not in tensors  # tied
    assert tensors[f"blk.{full}.layer_output_scale.weight"] == ([1], Q.F32)
    freqs = np.array(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data)
    assert list(freqs) == [1.0] * 32 + [1e30] * 96  # a quarter of the 128 pairs of a 256-wide full head turn
    a = "gemma4."
    want = {a + "attention.sliding_window_pattern": [kind == "sliding_attention" for kind in cfg.layer_types],
            a + "attention.sliding_window": 64, a + "attention.key_length": 256, a + "attention.key_length_swa": 128,
            a + "attention.value_length": 256, a + "attention.value_length_swa": 128, a + "rope.dimension_count": 256,
            a + "rope.dimension_count_swa": 128, a + "rope.freq_base": 1e6, a + "rope.freq_base_swa": 1e4,
            a + "attention.shared_kv_layers": 0, a + "embedding_length_per_layer_input": 0,
            a + "final_logit_softcapping": 30.0, a + "attention.head_count_kv": 1, a + "feed_forward_length": 512}
    if cfg.num_experts:
        want.update({a + "expert_count": 8, a + "expert_used_count": 2, a + "expert_feed_forward_length": 256})
        assert tensors["blk.0.ffn_gate_up_exps.weight"] == ([h, 512, 8], Q.Q4_K)
        assert tensors["blk.0.ffn_gate_inp.scale"] == ([h], Q.F32)
        assert tensors["blk.0.ffn_down_exps.scale"] == ([8], Q.F32)
    for key, value in want.items():
        assert _field(reader, key) == pytest.approx(value), key


def test_the_real_gemma4_shapes_are_listed_with_per_layer_kv_heads(tmp_path):
    for shape, kv in (("gemma4-31b", (16, 4)), ("gemma4-26b-a4b", (8, 2))):
        cfg = shapes.shape_config(shape)
        names = [target for _, target, _, _ in llama_cpp.tensor_plan(cfg, "q4_k_m")]
        assert len(names) == len(set(names)) and "rope_freqs.weight" in names
        assert cfg.layer_kv_heads == [kv[1] if kind == "full_attention" else kv[0] for kind in cfg.layer_types]
    # 30.7B and 25.2B weights in the Q4_K_M mix (Q4_K, Q6_K for ffn_down, attn_v and the tied embedding):
    # 4.5 to 5.5 bits a weight; 26B-A4B's 704-wide expert rows (no whole 256-value super-block) hold Q8_0
    # in place of Q6_K, llama.cpp's fallback: 5.5 to 6
    for shape, weights, most in (("gemma4-31b", 30.7e9, 5.5), ("gemma4-26b-a4b", 25.2e9, 6.0)):
        bits = 8 * llama_cpp.expected_file_bytes(shapes.shape_config(shape), "q4_k_m") / weights
        assert most - 1 < bits < most, (shape, bits)


def test_lucebox_loads_the_peer_s_file_as_the_model_of_the_shape(tmp_path):
    path = tmp_path / "moe.gguf"
    cfg = shapes.shape_config("tiny-gemma4-moe")
    llama_cpp.write_gguf(cfg, "q8_0", path)
    loaded = load_model(str(path), dtype="float32")
    for field in ("layer_types", "layer_head_dims", "layer_kv_heads", "kv_sources", "attention_k_eq_v", "num_experts",
                  "moe_intermediate_size", "sliding_windows", "final_logit_softcapping"):
        assert getattr(loaded.config, field) == getattr(cfg, field), field
    assert torch.isfinite(lucebox_logits(loaded, list(range(1, 30)))).all()
    assert GGUFReader(path).fields["general.architecture"].contents() == "gemma4"


@pytest.mark.skipif(not LLAMA_BENCH.is_file(), reason="no .llama/bin/llama-bench (scripts/build_llama_cpp.sh)")
@pytest.mark.parametrize("shape,quant", [("tiny-gemma4", "q4_k_m"), ("tiny-gemma4-moe", "iq4_xs")])
def test_llama_bench_runs_the_random_gemma4_ggufs(tmp_path, shape, quant):
    import subprocess
    path = tmp_path / f"{shape}.gguf"
    llama_cpp.write_gguf(shapes.shape_config(shape), quant, path)
    command = llama_cpp.bench_command(LLAMA_BENCH, path, [32], 8, [16], 1, ["--repack", "0", "-t", "1"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert llama_cpp.parse_bench_json(done.stdout)["model_type"].startswith("gemma4")
