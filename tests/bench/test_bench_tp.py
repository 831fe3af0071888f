"""`lucebox bench tp` and the random tensor-parallel shards it builds (two gloo ranks on the CPU)."""
from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lucebox.bench import shapes
from lucebox.bench.random_shards import RandomShards, logical_name
from lucebox.cli import main as cli_main
from lucebox.config import EngineArgs
from lucebox.errors import UnsupportedError
from lucebox.model.tensor_parallel import RowParallel, VocabParallelEmbedding
from lucebox.weights.quant import QuantLinear


def shard(shape: str, quant: str, rank: int, size: int = 2):
    shards = RandomShards(shape, quant, seed=3)
    args = shards.resolve(EngineArgs(tensor_parallel_size=size, device="cpu"))
    shards.check(args)
    loaded, full = shards.load(args, rank)
    assert full is None
    return loaded.model


def test_logical_names_drop_the_tensor_parallel_wrappers():
    assert logical_name("layers.3.self_attn.o_proj.local.weight") == "layers.3.self_attn.o_proj.weight"
    assert logical_name("embed_tokens.table.weight") == "embed_tokens.weight"
    assert logical_name("layers.0.mlp.moe.experts.down_proj") == "layers.0.mlp.experts.down_proj"


def test_each_rank_builds_only_its_bf16_shard_with_replicated_weights_equal():
    ranks = [shard("tiny", "bf16", rank) for rank in (0, 1)]
    whole = shapes.build_random_model("tiny", "bf16", torch.device("cpu"))
    for model in ranks:
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        attn = model.layers[0].self_attn
        assert attn.q_proj.weight.shape[0] == whole.model.layers[0].self_attn.q_proj.weight.shape[0] // 2
        assert isinstance(attn.o_proj, RowParallel) and isinstance(model.embed_tokens, VocabParallelEmbedding)
        assert model.embed_tokens.table.weight.shape[0] == whole.config.vocab_size // 2
    norms = [dict((n, p) for n, p in m.named_parameters() if "norm" in n) for m in ranks]
    assert norms[0] and all(torch.equal(norms[0][n], norms[1][n]) for n in norms[0])
    q0, q1 = (m.layers[i].self_attn.q_proj.weight for i, m in enumerate(ranks))
    assert not torch.equal(q0, q1) and 0.01 < q0.float().std().item() < 0.03  # each weight its own, near STD


def test_a_gguf_mix_shards_into_its_quantised_types():
    model = shard("tiny", "q4_k_m", 1)
    down = model.layers[1].mlp.down_proj.local
    assert isinstance(down, QuantLinear) and down.qtype == Q.Q6_K  # Q4_K_M keeps ffn_down in Q6_K
    gate = model.layers[1].mlp.gate_proj
    assert isinstance(gate, QuantLinear) and gate.qtype == Q.Q4_K
    # o_proj's shard reads 2 of 4 heads x 64 = 128 features: a 32-value type, as llama.cpp stores such rows
    assert model.layers[0].self_attn.o_proj.local.qtype == Q.Q5_0


def test_random_shards_refuse_what_they_cannot_build():
    shards = RandomShards("tiny", "bf16")
    with pytest.raises(UnsupportedError, match="KV heads"):
        shards.check(shards.resolve(EngineArgs(tensor_parallel_size=3, device="cpu")))
    with pytest.raises(UnsupportedError, match="DFlash"):
        shards.load(shards.resolve(EngineArgs(tensor_parallel_size=2, device="cpu")), 0, keep_full_vocab=True)


def test_bench_tp_measures_tp1_against_tp2_in_one_run(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert cli_main(["bench", "tp", "--shape", "tiny", "--quant", "q8_0", "--device", "cpu", "--prompt-len", "48",
                     "--context", "40", "--decode-tokens", "8", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    one, two = result["rows"]
    assert (one["size"], two["size"]) == (1, 2) and one["decode_speedup"] == 1.0
    for row in (one, two):
        assert row["decode_tok_s"] > 0 and row["ttft_s"] > 0 and row["verify_ratio"] > 0
        assert row["collective_s"] is None  # gloo: no kernel timeline to read
        forced = row["forced"]  # the engine's own continuation drafted: every draft accepted
        assert forced["converged"] and forced["tau"] > 4 and forced["speedup"] > 0
    assert two["efficiency"] == pytest.approx(two["decode_tok_s"] / one["decode_tok_s"] / 2)
    # rank 0 of two reads about half the weights a token (the norms and an embedding row are whole)
    assert 0.45 < two["rank0_weight_bytes_per_token"] / one["rank0_weight_bytes_per_token"] < 0.6
    table = capsys.readouterr().out
    assert "| 2 |" in table and "collectives a step" in table


def test_bench_tp_sizes_start_with_the_baseline(capsys):
    assert cli_main(["bench", "tp", "--shape", "tiny", "--device", "cpu", "--sizes", "2"]) != 0
    assert "--sizes starts with 1 (the baseline)" in capsys.readouterr().err
