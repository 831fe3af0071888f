"""The llama.cpp peer of `lucebox bench speed`: random GGUFs that llama.cpp's loaders take (read back
with gguf-py's GGUFReader: names, shapes, types, metadata, valid blocks), llama-bench's JSON, and the
peer phase end to end with a stand-in llama-bench that prints that JSON."""
from __future__ import annotations

import dataclasses

import json
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, GGUFReader
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from lucebox.bench import llama_cpp, shapes, speed, speed_report
from lucebox.weights.quant import QuantEmbedding, QuantLinear

SAMPLE = Path(__file__).with_name("llama_bench_sample.json")
# scripts/build_llama_cpp.sh's output (git-ignored): where it exists, llama.cpp itself loads our files
LLAMA_BENCH = Path(__file__).resolve().parents[2] / ".llama" / "bin" / "llama-bench"


def _write(tmp_path, shape: str, quant: str) -> tuple[GGUFReader, object]:
    cfg = shapes.shape_config(shape)
    path = tmp_path / f"{shape}-{quant}.gguf"
    size = llama_cpp.write_gguf(cfg, quant, path)
    assert size == path.stat().st_size and not path.with_name(path.name + ".part").exists()
    return GGUFReader(path), cfg


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def _arch_names(arch: str, layers: int) -> set[str]:
    """Every tensor name gguf-py lists for the architecture (llama.cpp's own table, in Python)."""
    kind = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    return {TENSOR_NAMES[t].format(bid=i) + suffix for t in MODEL_TENSORS[kind] for i in range(layers)
            for suffix in ("", ".weight", ".bias")}


@pytest.mark.parametrize("shape,arch", [("tiny-hybrid", "qwen35"), ("tiny-hybrid-moe", "qwen35moe"),
                                        ("tiny-moe", "qwen3moe"), ("tiny", "qwen3")])
@pytest.mark.parametrize("quant", ["bf16", "q4_k_m"])
def test_random_gguf_round_trips_with_llama_cpp_names_shapes_and_types(tmp_path, shape, arch, quant):
    reader, cfg = _write(tmp_path, shape, quant)
    assert _field(reader, "general.architecture") == arch
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) <= _arch_names(arch, cfg.num_layers)
    h, vocab = cfg.hidden_size, cfg.vocab_size
    big = Q.BF16 if quant == "bf16" else Q.Q4_K
    special = Q.BF16 if quant == "bf16" else Q.Q6_K
    expect = {"token_embd.weight": ([h, vocab], big), "output.weight": ([h, vocab], special),
              "output_norm.weight": ([h], Q.F32)}
    for i, kind in enumerate(cfg.layer_types or ["full_attention"] * cfg.num_layers):
        b = f"blk.{i}."
        expect[b + "attn_norm.weight"] = ([h], Q.F32)
        if kind == "linear_attention":  # llama.cpp's qwen35 load_arch_tensors, recurrent layers
            key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * 64
            heads, conv = cfg.linear_num_value_heads, 2 * key + value
            expect.update({b + "attn_qkv.weight": ([h, conv], special), b + "attn_gate.weight": ([h, value], big),
                           b + "ssm_conv1d.weight": ([4, conv], Q.F32), b + "ssm_dt.bias": ([heads], Q.F32),
                           b + "ssm_a": ([heads], Q.F32), b + "ssm_beta.weight": ([h, heads], Q.F32),
                           b + "ssm_alpha.weight": ([h, heads], Q.F32), b + "ssm_norm.weight": ([64], Q.F32),
                           b + "ssm_out.weight": ([value, h], big)})
        else:
            q = cfg.num_heads * cfg.head_dim * (2 if cfg.layer_types else 1)  # qwen35: query and output gate
            kv = cfg.num_kv_heads * cfg.head_dim
            expect.update({b + "attn_q.weight": ([h, q], big), b + "attn_k.weight": ([h, kv], big),
                           b + "attn_v.weight": ([h, kv], special),
                           b + "attn_output.weight": ([cfg.num_heads * cfg.head_dim, h], big),
                           b + "attn_q_norm.weight": ([cfg.head_dim], Q.F32),
                           b + "attn_k_norm.weight": ([cfg.head_dim], Q.F32)})
        expect[b + ("post_attention_norm.weight" if cfg.layer_types else "ffn_norm.weight")] = ([h], Q.F32)
        if cfg.num_experts:
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            expect.update({b + "ffn_gate_inp.weight": ([h, e], Q.F32), b + "ffn_gate_exps.weight": ([h, inter, e], big),
                           b + "ffn_up_exps.weight": ([h, inter, e], big),
                           b + "ffn_down_exps.weight": ([inter, h, e], special)})
            if cfg.shared_expert_intermediate_size:
                s = cfg.shared_expert_intermediate_size
                expect.update({b + "ffn_gate_shexp.weight": ([h, s], big), b + "ffn_up_shexp.weight": ([h, s], big),
                               b + "ffn_down_shexp.weight": ([s, h], special),
                               # [1, H] as HF holds it and llama.cpp's converter writes it ({n_embd} loads it too)
                               b + "ffn_gate_inp_shexp.weight": ([h, 1], Q.F32)})
        else:
            inter = cfg.intermediate_size
            expect.update({b + "ffn_gate.weight": ([h, inter], big), b + "ffn_up.weight": ([h, inter], big),
                           b + "ffn_down.weight": ([inter, h], special)})
    got = {name: ([int(d) for d in t.shape], t.tensor_type) for name, t in tensors.items()}
    assert got == expect
    for name, t in tensors.items():  # every tensor holds exactly its blocks
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        assert t.n_bytes == int(np.prod([int(d) for d in t.shape])) // block * size, name
    data = sum(t.n_bytes for t in reader.tensors)
    assert data == llama_cpp.expected_file_bytes(cfg, quant)


def test_metadata_is_what_llama_cpps_qwen35moe_loader_reads(tmp_path):
    reader, cfg = _write(tmp_path, "tiny-hybrid-moe", "q4_k_m")
    a = "qwen35moe."
    want = {a + "context_length": 4096, a + "embedding_length": 256, a + "block_count": 4,
            a + "attention.head_count": 2, a + "attention.head_count_kv": 1, a + "attention.key_length": 256,
            a + "attention.value_length": 256, a + "rope.dimension_count": 64, a + "rope.freq_base": 1e7,
            a + "rope.dimension_sections": [11, 11, 10, 0], a + "expert_count": 8, a + "expert_used_count": 2,
            a + "expert_feed_forward_length": 256, a + "expert_shared_feed_forward_length": 256,
            a + "ssm.conv_kernel": 4, a + "ssm.state_size": 64, a + "ssm.group_count": 2,
            a + "ssm.time_step_rank": 4, a + "ssm.inner_size": 256, a + "full_attention_interval": 4,
            "general.file_type": 15, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35"}
    for key, value in want.items():
        assert _field(reader, key) == pytest.approx(value), key
    assert _field(reader, a + "attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    # the 64 rotary dims of Qwen3.5's 256-dim heads, split as its mrope_section [11, 11, 10]
    assert shapes.shape_config("qwen3.6-27b").partial_rotary_factor * 256 == 64


def test_the_vocabulary_is_a_valid_byte_level_bpe_of_vocab_size_tokens(tmp_path):
    reader, cfg = _write(tmp_path, "tiny-moe", "q8_0")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == len(set(tokens)) == cfg.vocab_size
    assert "\u010a" in tokens  # the byte-level stand-in for "\n": llama.cpp looks the newline token up
    merges = _field(reader, "tokenizer.ggml.merges")
    assert all(a in tokens and b in tokens and a + b in tokens for a, b in (m.split(" ") for m in merges))
    types = reader.fields["tokenizer.ggml.token_type"]
    assert types.types[-1].name == "INT32" and len(types.data) == cfg.vocab_size  # llama.cpp wants int32
    assert _field(reader, "tokenizer.ggml.eos_token_id") < cfg.vocab_size


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0", "iq4_xs"])
def test_quantised_blocks_are_valid_varied_and_of_the_lucebox_models_sizes(tmp_path, quant):
    reader, cfg = _write(tmp_path, "tiny-hybrid", quant)
    tensors = {t.name: t for t in reader.tensors}
    embed = tensors["token_embd.weight"]
    values = dequantize(embed.data, embed.tensor_type).reshape(cfg.vocab_size, cfg.hidden_size)
    assert np.isfinite(values).all() and 0.01 < values.std() < 0.04
    assert len({row.tobytes() for row in values}) == cfg.vocab_size  # no two token embeddings alike
    router_free = tensors["blk.0.ssm_beta.weight"].data
    assert np.isfinite(router_free).all() and 0.01 < router_free.std() < 0.04
    # the lucebox model of the same shape and mix stores every quantised matrix in as many bytes
    model = shapes.build_random_model("tiny-hybrid", quant, torch.device("cpu")).model
    targets = {ours: theirs for ours, theirs, _, _ in llama_cpp.tensor_plan(cfg, quant)}
    for name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            target = targets[name + ".weight"]
            assert tensors[target].tensor_type == module.qtype, name
            assert tensors[target].n_bytes == module.qweight.numel(), name


def test_every_lucebox_tensor_of_each_shape_has_one_gguf_name():
    for shape in ("qwen3.6-27b", "qwen3.6-35b-a3b", "qwen3-30b-a3b", "qwen3-8b", "qwen3.5-0.8b"):
        cfg = shapes.shape_config(shape)
        plan = llama_cpp.tensor_plan(cfg, "q4_k_m")
        names = [target for _, target, _, _ in plan]
        assert len(names) == len(set(names)) and set(names) <= _arch_names(llama_cpp.arch_of(cfg), cfg.num_layers)
    with pytest.raises(ValueError, match="no GGUF architecture for model family 'llama'"):
        llama_cpp.arch_of(dataclasses.replace(shapes.shape_config("qwen3-8b"), family="llama"))


def test_real_shape_files_are_the_sizes_of_the_published_ggufs():
    """Qwen3.6-27B Q4_K_M and Qwen3-30B-A3B Q4_K_M GGUFs weigh about 16.5 and 18.6 GB (our mix gives
    every ffn_down Q6_K, so a little more); IQ4_XS less than Q4_K_M, Q8_0 about 1.06 bytes a weight."""
    sizes = {(s, q): llama_cpp.expected_file_bytes(shapes.shape_config(s), q) / 1e9
             for s in ("qwen3.6-27b", "qwen3-30b-a3b") for q in ("q4_k_m", "iq4_xs", "q8_0")}
    assert 16.0 < sizes["qwen3.6-27b", "q4_k_m"] < 19.5 and 18.0 < sizes["qwen3-30b-a3b", "q4_k_m"] < 21.0
    assert sizes["qwen3.6-27b", "iq4_xs"] < sizes["qwen3.6-27b", "q4_k_m"] < sizes["qwen3.6-27b", "q8_0"]
    assert 27.0 < sizes["qwen3.6-27b", "q8_0"] < 30.5


def test_llama_bench_json_becomes_prefill_and_decode_rows():
    """The sample follows llama-bench's json_printer (tools/llama-bench/llama-bench.cpp: test::get_fields,
    then samples_ns / samples_ts), for `-p 4096 -n 128 -d 0,512` cut to three tests."""
    parsed = llama_cpp.parse_bench_json(SAMPLE.read_text())
    assert parsed["model_type"] == "qwen35 27B Q4_K - Medium" and parsed["model_size"] == 17683087360
    assert parsed["prefill"] == [
        {"tok_s": 3000.02, "stddev_tok_s": 8.88, "depth": 0, "runs": 3, "prompt_len": 4096},
        {"tok_s": 2925.71, "stddev_tok_s": 6.27, "depth": 512, "runs": 3, "prompt_len": 4096}]
    assert parsed["decode"] == [{"tok_s": 80.0, "stddev_tok_s": 0.1, "depth": 512, "runs": 3, "context": 512,
                                 "tokens": 128}]
    with pytest.raises(ValueError, match="no tests"):
        llama_cpp.parse_bench_json("[]")


def test_the_llama_bench_command_runs_full_offload_with_flash_attention_at_each_depth():
    command = llama_cpp.bench_command("llama-bench", "m.gguf", [512, 4096], 128, [512, 4096], 3)
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags == {"-m": "m.gguf", "-ngl": "99", "-fa": "1", "-p": "512,4096", "-n": "128",
                     "-d": "0,512,4096", "-r": "3", "-o": "json"}


def test_bench_speed_with_the_llama_cpp_peer_end_to_end(tmp_path, capsys):
    """bench speed --peer llama.cpp on a tiny hybrid: the random GGUF is written, llama-bench (here a
    stand-in printing the sample) runs on it with the bench's lengths, the ratios follow, and the
    file is gone afterwards."""
    seen = tmp_path / "argv"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\nls -l \"$2\" >> {seen}\ncat {SAMPLE}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    work = tmp_path / "work"
    work.mkdir()
    args = speed.default_args(shape="tiny-hybrid", quant="q4_k_m", device="cpu", prompt_lens=[32], contexts=[32],
                              decode_tokens=4, repeats=1, skip=["reference", "verify", "spec"], peer="llama.cpp",
                              llama_bench=str(fake), peer_dir=str(work))
    result = speed.run(args)
    peer = result["peer"]
    argv = seen.read_text().split("\n")[0].split()
    assert argv[argv.index("-p") + 1] == "32" and argv[argv.index("-d") + 1] == "0,32"
    assert "lucebox-random-tiny-hybrid-q4_k_m.gguf" in seen.read_text() and list(work.iterdir()) == []
    assert peer["gguf_bytes"] > 0 and peer["model_type"].startswith("qwen35")
    assert peer["ratios"] == {"prefill": {}, "decode": {}}  # the sample's lengths are not the bench's
    sample = json.loads(SAMPLE.read_text())
    result["prefill"][0]["prompt_len"] = 4096
    result["decode"][0]["context"] = 512
    peer["ratios"] = llama_cpp.ratios(result["prefill"], result["decode"], llama_cpp.parse_bench_json(json.dumps(sample)))
    rows = {row[0]: row for row in speed_report.report_rows(result)}
    assert rows["llama.cpp prefill 4,096 tokens"][3] == f"{result['prefill'][0]['tok_s'] / 3000.02:.2f}x"
    assert rows["llama.cpp decode at context 512"][4].startswith(">= 1.3x")


def test_the_llama_cpp_peer_says_why_it_did_not_run(tmp_path):
    args = speed.default_args(shape="tiny-hybrid", quant="f32", device="cpu", prompt_lens=[32], contexts=[32],
                              decode_tokens=4, repeats=1, skip=["reference", "verify", "spec"], peer="llama.cpp",
                              llama_bench=str(tmp_path / "missing"))
    result = speed.run(args)
    assert "no llama-bench at" in result["peer"]["skipped"] and any("llama-bench" in n for n in result["notes"])


@pytest.mark.skipif(not LLAMA_BENCH.is_file(), reason="no .llama/bin/llama-bench (scripts/build_llama_cpp.sh)")
@pytest.mark.parametrize("shape,quant", [("tiny-hybrid", "q4_k_m"), ("tiny-hybrid-moe", "iq4_xs"),
                                         ("tiny-moe", "q8_0"), ("tiny-hybrid", "bf16")])
def test_llama_bench_loads_and_runs_the_random_ggufs(tmp_path, shape, quant):
    path = tmp_path / f"{shape}.gguf"
    llama_cpp.write_gguf(shapes.shape_config(shape), quant, path)
    # --repack 0: the CPU backend's AMX repacking crashes in VMs without AMX tile permission
    command = llama_cpp.bench_command(LLAMA_BENCH, path, [32], 8, [16], 1, ["--repack", "0", "-t", "1"])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = llama_cpp.parse_bench_json(done.stdout)
    assert [r["prompt_len"] for r in parsed["prefill"]] == [32, 32] and parsed["prefill"][0]["tok_s"] > 0
    assert [(r["context"], r["tokens"]) for r in parsed["decode"]] == [(0, 8), (16, 8)]
    assert parsed["model_type"].startswith(llama_cpp.arch_of(shapes.shape_config(shape)))
