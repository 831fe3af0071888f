"""GGUF for the MoE and hybrid architectures (llama.cpp's qwen3moe, qwen35, qwen35moe): `lucebox convert`
writes them, the loader reads them back to what transformers computes, quantised experts stay quantised,
a file laid out by llama.cpp's own convention (tests/gguf_files.py writes it with the `gguf` package)
loads the same, and bad files name the tensor at fault."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

from lucebox import LLM, SamplingParams
from lucebox.convert import convert_hf_to_gguf
from lucebox.errors import CheckpointError, UnsupportedError
from lucebox.model.loader import load_model
from lucebox.model.moe import expert_weights
from lucebox.weights.quant import PermutedInputQuantLinear, QuantLinear, QuantTensor

from tests.conftest import build_hf_model
from tests.gguf_files import (
    copy_fields, dequantised_copy, finish, llama_cpp_gguf, lucebox_logits, prompt_for, rewritten)
from tests.model.test_qwen3_5 import reference_logits

DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
# Fewer key heads than value heads, three per key head, so llama.cpp's tiled value-head order is not its own
# inverse; widths that are
# whole Q8_0 blocks, so every matrix (ssm_out included) is quantised in the Q8_0 files.
ARCHS = {
    "qwen35": dict(model_type="qwen3_5_text", num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], **DELTANET),
    "qwen35moe": dict(model_type="qwen3_5_moe_text", num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      layer_types=["linear_attention", "full_attention"] * 2, **DELTANET),
    "qwen3moe": dict(model_type="qwen3_moe", head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer_dir):
    return {arch: build_hf_model("qwen3", tmp_path_factory.mktemp(arch), tokenizer_dir, **spec)
            for arch, spec in ARCHS.items()}


@pytest.fixture(scope="module")
def ggufs(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    return {(arch, qtype): convert_hf_to_gguf(hf_dirs[arch], out / f"{arch}-{qtype}.gguf", qtype)
            for arch in ARCHS for qtype in ("f32", "q8_0")}


@pytest.fixture(scope="module")
def references(hf_dirs):
    from transformers import AutoModelForCausalLM
    return {arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for arch, path in hf_dirs.items()}


# ------------------------------------------------------------------------------------ our writer, F32
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_logits_equal_transformers(arch, ggufs, references):
    loaded = load_model(str(ggufs[arch, "f32"]), dtype="float32", device="cpu")
    assert GGUFReader(ggufs[arch, "f32"]).fields["general.architecture"].contents() == arch
    prompt = prompt_for(loaded.config.vocab_size)
    assert (lucebox_logits(loaded, prompt) - reference_logits(references[arch], prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_config_equals_the_hf_config(arch, ggufs, hf_dirs):
    ours, hf = load_model(str(ggufs[arch, "f32"])).config, load_model(str(hf_dirs[arch])).config
    for field in ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "eos_token_ids", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
                  "moe_layers", "layer_types", "partial_rotary_factor", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
        assert getattr(ours, field) == getattr(hf, field), field


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tensor_table_lists_what_the_converter_writes(arch, ggufs, hf_dirs):
    """llama_cpp_tensors(cfg): the names and shapes of a file for a config (random-weight benchmark files)."""
    from lucebox.model.gguf_hybrid_write import llama_cpp_tensors
    written = {t.name: tuple(reversed(t.shape.tolist())) for t in GGUFReader(ggufs[arch, "f32"]).tensors}
    listed = {name: shape for name, shape, *_ in llama_cpp_tensors(load_model(str(hf_dirs[arch])).config)}
    assert listed == written


def llama_cpp_turns_every_pair(sections: list[int], pairs: int) -> bool:
    """llama.cpp's interleaved MRoPE (ggml_mrope_cache_init): pair i takes the t, h or w position as
    sector % 3 is 0, 1, 2 and sector < 3 * that section, with sector = i % sum(sections); any other pair
    takes the 4th position, which is 0 for text, so it would not turn at all."""
    total = sum(sections)
    if not 0 < total <= 2 * pairs:  # GGML_ASSERT(sect_dims <= ne0)
        return False
    return all(i % total < 3 * sections[(i % total) % 3] for i in range(pairs))


@pytest.mark.parametrize("head_dim, factor, given, want", [(256, 0.25, None, [11, 11, 10, 0]),
                                                            (256, 0.25, [11, 11, 10], [11, 11, 10, 0]),
                                                            (16, 0.25, [11, 11, 10], [1, 1, 0, 0]),
                                                            (128, 1.0, None, [22, 21, 21, 0])])
def test_mrope_sections_turn_every_rotary_pair_in_llama_cpp(head_dim, factor, given, want, ggufs):
    from types import SimpleNamespace

    from lucebox.model.gguf_hybrid_config import mrope_sections_for
    got = mrope_sections_for(SimpleNamespace(head_dim=head_dim, partial_rotary_factor=factor), given)
    assert got == want and llama_cpp_turns_every_pair(got, int(head_dim * factor) // 2)
    assert not llama_cpp_turns_every_pair([2, 0, 0, 0], 2)  # pair 1 would keep position 0
    written = GGUFReader(ggufs["qwen35moe", "f32"]).fields["qwen35moe.rope.dimension_sections"].contents()
    assert llama_cpp_turns_every_pair(written, 2)


def test_llama_cpp_layout_of_the_written_deltanet_tensors(ggufs, hf_dirs):
    """ssm_a = -exp(A_log), conv1d without its middle axis, value heads in llama.cpp's tiled order."""
    from safetensors.torch import load_file
    hf = load_file(hf_dirs["qwen35"] / "model.safetensors")
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(ggufs["qwen35", "f32"]).tensors}
    p = "model.layers.0.linear_attn."
    tiled = [0, 3, 1, 4, 2, 5]  # value heads of key heads (0: v0-v2), (1: v3-v5) -> v0, v3, v1, v4, v2, v5
    assert torch.allclose(stored["blk.0.ssm_a"], -hf[p + "A_log"].exp()[tiled])
    assert torch.equal(stored["blk.0.ssm_dt.bias"], hf[p + "dt_bias"][tiled])
    assert torch.equal(stored["blk.0.ssm_beta.weight"], hf[p + "in_proj_b.weight"][tiled])
    z, out = hf[p + "in_proj_z.weight"], hf[p + "out_proj.weight"]
    assert torch.equal(stored["blk.0.attn_gate.weight"], z.view(6, 16, 64)[tiled].reshape(96, 64))
    assert torch.equal(stored["blk.0.ssm_conv1d.weight"][:64], hf[p + "conv1d.weight"][:64, 0])
    assert torch.equal(stored["blk.0.ssm_out.weight"], out.view(64, 6, 16)[:, tiled].reshape(64, 96))
    assert torch.allclose(stored["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + 1)
    assert torch.equal(stored["blk.0.ssm_norm.weight"], hf[p + "norm.weight"])


# ------------------------------------------------------------------------------------ our writer, Q8_0
@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_keeps_experts_quantised_and_computes_its_dequantised_values(arch, ggufs, references, tmp_path):
    loaded = load_model(str(ggufs[arch, "q8_0"]), dtype="float32", device="cpu")
    mlps = [layer.mlp for layer in loaded.model.layers]
    if arch != "qwen35":
        for mlp in mlps:  # stacked [E, out, in], raw Q8_0 rows [E * out, bytes]
            assert isinstance(mlp.experts.gate_up_proj, QuantTensor) and mlp.experts.gate_up_proj.qtype == Q.Q8_0
            assert mlp.experts.gate_up_proj.shape == (8, 64, 64) and mlp.experts.down_proj.shape == (8, 64, 32)
            assert mlp.experts.gate_up_proj.data.shape == (8 * 64, 64 // 32 * 34)
        assert not any(name.endswith("experts.gate_up_proj") for name, _ in loaded.model.named_parameters())
    if arch != "qwen3moe":
        deltanet = loaded.model.layers[0].linear_attn
        assert isinstance(deltanet.in_proj_qkv, QuantLinear) and isinstance(deltanet.out_proj, PermutedInputQuantLinear)
    float_copy = load_model(str(dequantised_copy(ggufs[arch, "q8_0"], tmp_path / "f32.gguf")), dtype="float32", device="cpu")
    prompt = prompt_for(loaded.config.vocab_size, seed=2)
    got = lucebox_logits(loaded, prompt)
    assert (got - lucebox_logits(float_copy, prompt)).abs().max().item() <= 1e-4
    # Against the unquantised model: Q8_0 (8 bits and a scale per 32 weights) moves these tiny models'
    # logits by 0.01-0.08 of their ~1-2, up to ~0.2 at a position where a top-2 routing choice flips;
    # a layout mistake moves them by their own size.
    assert (got - reference_logits(references[arch], prompt)).abs().max().item() <= 0.4
    if arch != "qwen3moe":  # fused as an engine fuses: the gated norm writes ssm_out's stored head order
        loaded.model.fuse_projections()
        assert deltanet.out_heads is not None
        assert (lucebox_logits(loaded, prompt) - got).abs().max().item() <= 1e-4
    if arch != "qwen3moe":  # DeltaNet's input projections fuse, as one or as qkv | z and b | a
        loaded.model.fuse_projections()
        kinds = {(type(m.in_proj_qkv), type(m.in_proj_b)) for m in (layer.linear_attn for layer in loaded.model.layers
                                                                     if hasattr(layer, "linear_attn"))}
        assert all(m.projections is not None or (m.qkvz is not None and m.ba is not None)
                   for m in (layer.linear_attn for layer in loaded.model.layers if hasattr(layer, "linear_attn")))
        assert (lucebox_logits(loaded, prompt) - got).abs().max().item() <= 1e-5, kinds


def test_expert_weights_dequantises_only_the_selected_experts():
    values = torch.randn(5, 6, 64, generator=torch.Generator().manual_seed(0))
    blocks = torch.from_numpy(gguf.quants.quantize(values.numpy(), Q.Q8_0)).reshape(30, -1)
    stacked = QuantTensor(blocks, Q.Q8_0, (5, 6, 64), "experts")
    whole = stacked.dequantize()
    ids = torch.tensor([3, 0, 3, 4])
    assert torch.equal(expert_weights(stacked, ids, torch.float32), whole[ids])
    assert torch.equal(expert_weights(stacked, 2, torch.float32), whole[2])
    assert expert_weights(stacked, ids, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(expert_weights(values, ids, torch.float32), values[ids])
    assert (whole - values).abs().max() < 0.05


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_quantised_experts_compute_what_the_gguf_package_dequantises(qtype):
    """Every quantised type lucebox reads, as stacked experts: the gathered (few tokens) and grouped
    (many tokens) products equal float experts holding gguf-py's dequantisation of the same bytes."""
    from lucebox.bench.shapes import random_quant_tensor
    from lucebox.model.moe import Experts

    torch.manual_seed(0)
    experts, hidden, inter = 4, 256, 256
    quantised, floats = Experts(experts, hidden, inter), Experts(experts, hidden, inter)
    for name, out, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        rows = random_quant_tensor(qtype, experts * out, cols, "cpu", name)
        stacked = QuantTensor(rows.data, qtype, (experts, out, cols), name)
        reference = gguf.quants.dequantize(rows.data.numpy(), qtype).reshape(experts, out, cols)
        delattr(quantised, name)
        setattr(quantised, name, stacked)
        setattr(floats, name, torch.nn.Parameter(torch.from_numpy(np.array(reference, np.float32))))
    for tokens in (3, 40):  # 6 routed rows: gathered; 80: grouped
        x = torch.randn(tokens, hidden)
        ids = torch.randint(0, experts, (tokens, 2))
        weights = torch.rand(tokens, 2)
        with torch.no_grad():
            want = floats(x, ids, weights)
            assert torch.allclose(quantised(x, ids, weights), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3moe"])
def test_quantised_moe_generates_greedily_like_its_dequantised_copy(arch, ggufs, tmp_path):
    """Through the engine (scheduler, fused projections, recurrent slots, chunked prefill): the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    float_path = dequantised_copy(ggufs[arch, "q8_0"], tmp_path / "f32.gguf")
    outputs = []
    for path in (ggufs[arch, "q8_0"], float_path):
        llm = LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=2, kv_cache_memory=64 << 20)
        prompts = [prompt_for(llm.engine.loaded.config.vocab_size, n, seed=n) for n in (13, 6)]
        outputs.append([list(o.outputs[0].token_ids) for o in
                        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


# --------------------------------------------------------------------- llama.cpp's convention, by hand
LLAMA_CPP_NAMES = {
    "qwen35moe": {"blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight",
                  "blk.0.post_attention_norm.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.1.attn_q.weight"},
    "qwen35": {"blk.0.ssm_conv1d.weight", "blk.0.ssm_alpha.weight", "blk.0.ssm_out.weight", "blk.0.ffn_gate.weight",
               "blk.3.attn_q_norm.weight"},
    "qwen3moe": {"blk.0.ffn_norm.weight", "blk.0.ffn_gate_inp.weight", "blk.2.ffn_down_exps.weight"},
}


@pytest.mark.parametrize("arch, fuse_gate_up", [("qwen35moe", False), ("qwen35moe", True), ("qwen35", False),
                                                ("qwen3moe", False)],
                         ids=["qwen35moe", "qwen35moe-fused-gate-up", "qwen35", "qwen3moe"])
def test_a_gguf_in_llama_cpp_convention_loads_to_transformers_logits(arch, fuse_gate_up, hf_dirs, ggufs, references,
                                                                      tmp_path):
    path = llama_cpp_gguf(arch, hf_dirs[arch], ggufs[arch, "f32"], tmp_path / "ll.gguf", fuse_gate_up)
    assert LLAMA_CPP_NAMES[arch] <= {t.name for t in GGUFReader(path).tensors}
    loaded = load_model(str(path), dtype="float32", device="cpu")
    prompt = prompt_for(loaded.config.vocab_size, seed=4)
    assert (lucebox_logits(loaded, prompt) - reference_logits(references[arch], prompt)).abs().max() <= 1e-4


# ------------------------------------------------------------------------------------------ bad files
def test_mtp_blocks_after_the_layers_are_skipped(ggufs, references, tmp_path):
    """llama.cpp counts Qwen 3.5's multi-token-prediction block in block_count (nextn_predict_layers)."""
    reader = GGUFReader(ggufs["qwen35", "f32"])
    writer = GGUFWriter(tmp_path / "mtp.gguf", "qwen35")
    copy_fields(reader, writer, skip=("general.architecture",), override={"qwen35.block_count": 5})
    writer.add_nextn_predict_layers(1)
    recurrent = reader.fields["qwen35.attention.recurrent_layers"].contents()
    assert recurrent == [True, True, True, False]
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
        if t.name.startswith("blk.3."):  # the MTP block: a full-attention block (plus its own tensors)
            writer.add_tensor(t.name.replace("blk.3.", "blk.4."), np.array(t.data))
    writer.add_tensor("blk.4.nextn.eh_proj.weight", np.zeros((64, 128), np.float32))
    finish(writer)
    loaded = load_model(str(tmp_path / "mtp.gguf"), dtype="float32", device="cpu")
    assert loaded.config.num_layers == 4
    prompt = prompt_for(loaded.config.vocab_size, seed=5)
    assert (lucebox_logits(loaded, prompt) - reference_logits(references["qwen35"], prompt)).abs().max() <= 1e-4


def test_a_missing_ssm_tensor_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["qwen35", "f32"], tmp_path / "bad.gguf", drop=("blk.2.ssm_a",))
    with pytest.raises(CheckpointError,
                       match=r"missing tensor blk\.2\.ssm_a \(the model's layers\.2\.linear_attn\.A_log\)"):
        load_model(path)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3moe"])
def test_expert_count_not_matching_the_tensors_is_named(arch, ggufs, tmp_path):
    path = rewritten(ggufs[arch, "q8_0"], tmp_path / "bad.gguf", keys={f"{arch}.expert_count": 6})
    with pytest.raises(CheckpointError, match=rf"tensor blk\.0\.ffn_gate_inp\.weight has shape \[8, 64\], but "
                                              rf"{arch}\.expert_count \(6\) .* make it \[6, 64\]"):
        load_model(path)


def test_a_missing_dense_ffn_width_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["qwen35", "f32"], tmp_path / "bad.gguf", drop=("qwen35.feed_forward_length",))
    with pytest.raises(CheckpointError, match=r"required metadata key qwen35\.feed_forward_length is missing"):
        load_model(path)


def test_a_positive_ssm_a_is_named(ggufs, tmp_path):
    reader = {t.name: t for t in GGUFReader(ggufs["qwen35", "f32"]).tensors}
    positive = np.abs(np.array(reader["blk.1.ssm_a"].data))
    path = rewritten(ggufs["qwen35", "f32"], tmp_path / "bad.gguf", tensors={"blk.1.ssm_a": (positive, Q.F32)})
    with pytest.raises(CheckpointError, match=r"tensor blk\.1\.ssm_a holds -exp\(A_log\), so every value must be "
                                              r"negative"):
        load_model(path)


def test_gate_and_up_experts_of_different_quantised_types_are_refused(ggufs, tmp_path):
    reader = {t.name: t for t in GGUFReader(ggufs["qwen3moe", "f32"]).tensors}
    up = np.array(reader["blk.1.ffn_up_exps.weight"].data)
    path = rewritten(ggufs["qwen3moe", "q8_0"], tmp_path / "bad.gguf",
                     tensors={"blk.1.ffn_up_exps.weight": (gguf.quants.quantize(up, Q.Q4_0), Q.Q4_0)})
    with pytest.raises(UnsupportedError, match=r"blk\.1\.ffn_gate_exps\.weight \+ blk\.1\.ffn_up_exps\.weight have "
                                               r"different types"):
        load_model(path)


def test_a_qwen35_style_pre_tokenizer_is_named_qwen35_and_tokenizes_the_same(tokenizer_dir, tmp_path):
    import shutil

    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from lucebox.text.gguf_vocab import QWEN35_REGEX

    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save(str(tok_dir / "tokenizer.json"))
    hf_dir = build_hf_model("qwen3", tmp_path / "hf", tok_dir, **ARCHS["qwen35"])
    path = convert_hf_to_gguf(hf_dir, tmp_path / "q.gguf", "f32")
    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "qwen35"
    ours, hf = load_model(str(path)).tokenizer, load_model(str(hf_dir)).tokenizer
    text = "x = 12345 + 678;\n\n  print('hello world')  # it's Über 東京"
    assert ours.encode(text) == hf.encode(text)
