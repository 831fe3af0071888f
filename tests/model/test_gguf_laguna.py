"""GGUF `laguna` (Poolside Laguna as llama.cpp stores it): `lucebox convert` writes it with llama.cpp's tensor
names and metadata keys, the loader reads it back to what transformers computes (full and sliding layers
with per-layer head counts, YaRN on the full layers, per-head and per-channel output gates, dense and MoE
layers, the sigmoid router with its selection bias, the shared expert), quantised experts stay quantised,
and bad files name the tensor or key at fault. llama.cpp itself was cross-checked outside CI (the report's
script): its logits of these files agree with transformers' within 4e-4."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, TokenType

from lucebox import LLM, SamplingParams
from lucebox.convert import convert_hf_to_gguf
from lucebox.errors import CheckpointError, UnsupportedError
from lucebox.model.loader import load_model
from lucebox.weights.quant import QuantLinear, QuantTensor
from tests.gguf_files import dequantised_copy, lucebox_logits, prompt_for, rewritten
from tests.model.test_laguna import FULL, SLIDING, build_laguna, with_config
from tests.model.test_qwen3_5 import reference_logits

# Expert widths of whole Q8_0 blocks, so every expert matrix is quantised in the Q8_0 files.
VARIANTS = {
    # test_laguna's config: YaRN full layers, window 5, heads [4, 6, 2, 8], per-head gate, a dense first layer,
    # soft-capped sigmoid router (a key only lucebox reads), routed scaling 2.5
    "per_head": dict(moe_intermediate_size=32, shared_expert_intermediate_size=64),
    # per-channel gate, two leading dense layers, llama.cpp's own 1-in-4 full layout, tied embeddings
    "per_channel": dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, gating="per-element",
                        mlp_layer_types=["dense", "dense", "sparse", "sparse"], tie_word_embeddings=True,
                        layer_types=[FULL, SLIDING, SLIDING, SLIDING], moe_router_logit_softcapping=0.0),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer_dir):
    return {name: build_laguna(tmp_path_factory.mktemp(name), tokenizer_dir, **spec) for name, spec in VARIANTS.items()}


@pytest.fixture(scope="module")
def ggufs(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    return {(name, qtype): convert_hf_to_gguf(hf_dirs[name], out / f"{name}-{qtype}.gguf", qtype)
            for name in VARIANTS for qtype in ("f32", "q8_0")}


@pytest.fixture(scope="module")
def references(hf_dirs):
    from transformers import AutoModelForCausalLM
    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in hf_dirs.items()}


@pytest.mark.parametrize("name", VARIANTS)
def test_f32_gguf_logits_equal_transformers(name, ggufs, references):
    loaded = load_model(str(ggufs[name, "f32"]), dtype="float32")
    prompt = prompt_for(loaded.config.vocab_size)  # 29 tokens: past the 5-token window
    assert (lucebox_logits(loaded, prompt) - reference_logits(references[name], prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", VARIANTS)
def test_gguf_config_equals_the_hf_config(name, ggufs, hf_dirs):
    ours, hf = load_model(str(ggufs[name, "f32"])).config, load_model(str(hf_dirs[name])).config
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_kv_heads", "head_dim",
                  "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "eos_token_ids", "sliding_windows",
                  "attention_kinds", "heads_per_layer", "gate_per_head", "partial_rotary_factor",
                  "sliding_partial_rotary_factor", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "moe_layers", "router_sigmoid",
                  "router_logit_softcap", "routed_scaling_factor", "router_weights_on_input"):
        assert getattr(ours, field) == getattr(hf, field), field
    for field in ("type", "theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        assert getattr(ours.rope, field) == getattr(hf.rope, field), field
        assert getattr(ours.sliding_rope, field) == getattr(hf.sliding_rope, field), field


@pytest.mark.parametrize("name", VARIANTS)
def test_the_tensor_table_lists_what_the_converter_writes(name, ggufs, hf_dirs):
    """llama_cpp_tensors(cfg): the names and shapes of a file for a config (random-weight benchmark files)."""
    from lucebox.model.gguf_hybrid_write import llama_cpp_tensors
    written = {t.name: tuple(reversed(t.shape.tolist())) for t in GGUFReader(ggufs[name, "f32"]).tensors}
    listed = {name: shape for name, shape, *_ in llama_cpp_tensors(load_model(str(hf_dirs[name])).config)}
    assert listed == written


# ------------------------------------------------------------------------ llama.cpp's names and keys
# Read in the llama.cpp tree of the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp), not parsed here: the
# installed gguf package has no LAGUNA. Tensor names: gguf-py/gguf/constants.py TENSOR_NAMES of the
# MODEL_TENSORS[MODEL_ARCH.LAGUNA] list; which of them a layer needs and their dims (ggml order, ne0 first):
# src/models/laguna.cpp load_arch_tensors (exp_probs_b is a "bias", every other tensor a "weight").
def llama_cpp_laguna_tensors(h, vocab, heads, kv, head_dim, gate_rows, lead, experts, inter, shared, dense,
                             tied) -> dict[str, list[int]]:
    want = {"token_embd.weight": [h, vocab], "output_norm.weight": [h]}
    if not tied:
        want["output.weight"] = [h, vocab]
    for i, n in enumerate(heads):
        b = f"blk.{i}."
        want.update({b + "attn_norm.weight": [h], b + "attn_q.weight": [h, n * head_dim],
                     b + "attn_k.weight": [h, kv * head_dim], b + "attn_v.weight": [h, kv * head_dim],
                     b + "attn_output.weight": [n * head_dim, h], b + "attn_q_norm.weight": [head_dim],
                     b + "attn_k_norm.weight": [head_dim], b + "attn_gate.weight": [h, gate_rows(n)],
                     b + "ffn_norm.weight": [h]})
        if i >= lead:
            want.update({b + "ffn_gate_inp.weight": [h, experts], b + "exp_probs_b.bias": [experts],
                         b + "ffn_gate_exps.weight": [h, inter, experts], b + "ffn_up_exps.weight": [h, inter, experts],
                         b + "ffn_down_exps.weight": [inter, h, experts], b + "ffn_gate_shexp.weight": [h, shared],
                         b + "ffn_up_shexp.weight": [h, shared], b + "ffn_down_shexp.weight": [shared, h]})
        else:
            want.update({b + "ffn_gate.weight": [h, dense], b + "ffn_up.weight": [h, dense],
                         b + "ffn_down.weight": [dense, h]})
    return want


@pytest.mark.parametrize("name", VARIANTS)
def test_names_shapes_and_keys_are_llama_cpps(name, ggufs, hf_dirs):
    raw = json.loads((hf_dirs[name] / "config.json").read_text())
    reader = GGUFReader(ggufs[name, "q8_0"])
    heads, head_dim = raw["num_attention_heads_per_layer"], raw["head_dim"]
    lead = raw["mlp_layer_types"].index("sparse")
    want = llama_cpp_laguna_tensors(
        raw["hidden_size"], raw["vocab_size"], heads, raw["num_key_value_heads"], head_dim,
        (lambda n: n) if raw["gating"] in (True, "per-head") else (lambda n: n * head_dim), lead,
        raw["num_experts"], raw["moe_intermediate_size"], raw["shared_expert_intermediate_size"],
        raw["intermediate_size"], raw["tie_word_embeddings"])
    assert {t.name: t.shape.tolist() for t in reader.tensors} == want
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.3.ffn_gate_exps.weight"] == types["blk.3.attn_gate.weight"] == Q.Q8_0
    assert types["blk.3.ffn_gate_inp.weight"] == types["blk.3.exp_probs_b.bias"] == Q.F32  # as llama.cpp's converter
    # Keys: gguf-py/gguf/constants.py Keys (LLM, Attention, Rope), spelled for arch "laguna"; the values are
    # what conversion/laguna.py + base.py write for this config.
    rope, swa = raw["rope_parameters"][FULL], raw["rope_parameters"][SLIDING]
    sliding = [kind == SLIDING for kind in raw["layer_types"]]
    keys = {"general.architecture": "laguna", "laguna.block_count": 4, "laguna.context_length": 256,
            "laguna.embedding_length": 64, "laguna.feed_forward_length": 96, "laguna.vocab_size": raw["vocab_size"],
            "laguna.attention.head_count": heads, "laguna.attention.head_count_kv": 2,
            "laguna.attention.key_length": 16, "laguna.attention.value_length": 16,
            "laguna.attention.sliding_window": 5, "laguna.attention.sliding_window_pattern": sliding,
            "laguna.rope.freq_base": rope["rope_theta"], "laguna.rope.freq_base_swa": swa["rope_theta"],
            "laguna.rope.dimension_count": 8, "laguna.rope.dimension_count_swa": 16,
            "laguna.rope.scaling.type": "yarn", "laguna.rope.scaling.factor": 4.0,
            "laguna.rope.scaling.original_context_length": 64, "laguna.rope.scaling.yarn_beta_fast": 32.0,
            "laguna.rope.scaling.yarn_beta_slow": 1.0, "laguna.leading_dense_block_count": lead,
            "laguna.expert_count": 8, "laguna.expert_used_count": 3, "laguna.expert_feed_forward_length": 32,
            "laguna.expert_shared_feed_forward_length": 64, "laguna.expert_weights_norm": True,
            "laguna.expert_weights_scale": 2.5, "laguna.expert_gating_func": 2,  # ExpertGatingFuncType.SIGMOID
            "tokenizer.ggml.model": "gpt2"}
    got = {key: reader.fields[key].contents() for key in keys if key in reader.fields}
    assert got == pytest.approx(keys)
    softcap = reader.fields.get("laguna.router_logit_softcapping")  # Keys.LLM.ROUTER_LOGIT_SOFTCAPPING
    assert (softcap.contents() if softcap else 0.0) == pytest.approx(raw["moe_router_logit_softcapping"])


def test_a_file_in_llama_cpps_layout_convention_loads(ggufs, references, tmp_path):
    """What llama.cpp's converter writes differs from ours only in leaving out the per-layer window pattern
    (its loader then takes every 4th layer, from layer 0, as full)."""
    path = rewritten(ggufs["per_channel", "f32"], tmp_path / "llama.gguf", drop=("laguna.attention.sliding_window_pattern",))
    loaded = load_model(path, dtype="float32")
    assert loaded.config.attention_kinds == [FULL, SLIDING, SLIDING, SLIDING]
    prompt = prompt_for(loaded.config.vocab_size, seed=3)
    assert (lucebox_logits(loaded, prompt) - reference_logits(references["per_channel"], prompt)).abs().max() <= 1e-4


def test_a_softmax_router_round_trips(hf_dirs, tmp_path):
    """transformers' Laguna routes by sigmoid only; lucebox's softmax router (tested against transformers in
    test_laguna) is written as expert_gating_func 1 and computes the same from the GGUF as from HF files."""
    hf = with_config(hf_dirs["per_head"], tmp_path, moe_router_use_sigmoid=False)
    path = convert_hf_to_gguf(hf, tmp_path / "softmax.gguf", "f32")
    assert GGUFReader(path).fields["laguna.expert_gating_func"].contents() == 1
    ours, theirs = load_model(str(path), dtype="float32"), load_model(str(hf), dtype="float32")
    assert not ours.config.router_sigmoid
    prompt = prompt_for(ours.config.vocab_size, seed=4)
    assert (lucebox_logits(ours, prompt) - lucebox_logits(theirs, prompt)).abs().max() <= 1e-5


def test_a_yarn_attention_factor_is_written_as_llama_cpp_applies_it(tokenizer_dir, tmp_path):
    """llama.cpp multiplies YaRN's own 0.1 ln(factor) + 1 by rope.scaling.attn_factor (llama-context.cpp),
    where transformers' attention_factor replaces it: the key holds their ratio (checked against llama.cpp's
    logits by scripts/check_gguf_laguna.py's files on CPU: 0.07 off with the plain value, 5e-4 with this)."""
    from transformers import AutoModelForCausalLM
    rope = {FULL: {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 64,
                   "partial_rotary_factor": 0.5, "attention_factor": 1.0},
            SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
    hf = build_laguna(tmp_path / "hf", tokenizer_dir, **dict(VARIANTS["per_head"], rope_parameters=rope))
    path = convert_hf_to_gguf(hf, tmp_path / "yarn.gguf", "f32")
    key = GGUFReader(path).fields["laguna.rope.scaling.attn_factor"].contents()
    assert key == pytest.approx(1.0 / (0.1 * np.log(4.0) + 1.0))
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.rope.attention_factor == pytest.approx(1.0)
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = prompt_for(loaded.config.vocab_size, seed=5)
    assert (lucebox_logits(loaded, prompt) - reference_logits(reference, prompt)).abs().max() <= 1e-4


# ------------------------------------------------------------------------------------------- Q8_0
@pytest.mark.parametrize("name", VARIANTS)
def test_q8_0_keeps_experts_quantised_and_computes_its_dequantised_values(name, ggufs, references, tmp_path):
    loaded = load_model(str(ggufs[name, "q8_0"]), dtype="float32")
    for layer, sparse in zip(loaded.model.layers, loaded.config.moe_layers):
        assert isinstance(layer.self_attn.g_proj, QuantLinear)
        if sparse:  # stacked [E, out, in], raw Q8_0 rows [E * out, bytes]
            experts = layer.mlp.experts
            assert isinstance(experts.gate_up_proj, QuantTensor) and experts.gate_up_proj.qtype == Q.Q8_0
            assert experts.gate_up_proj.shape == (8, 64, 64) and experts.down_proj.shape == (8, 64, 32)
            assert experts.gate_up_proj.data.shape == (8 * 64, 64 // 32 * 34)
    float_copy = load_model(str(dequantised_copy(ggufs[name, "q8_0"], tmp_path / "f32.gguf")), dtype="float32")
    prompt = prompt_for(loaded.config.vocab_size, seed=2)
    got = lucebox_logits(loaded, prompt)
    assert (got - lucebox_logits(float_copy, prompt)).abs().max().item() <= 1e-4
    # Q8_0 moves these tiny models' logits by ~0.01-0.08 (a routing flip ~0.2); a layout mistake by their size.
    assert (got - reference_logits(references[name], prompt)).abs().max().item() <= 0.4


def test_quantised_laguna_generates_greedily_like_its_dequantised_copy(ggufs, tmp_path):
    """Through the engine (scheduler, window KV groups, fused projections, chunked prefill): the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for path in (ggufs["per_head", "q8_0"], dequantised_copy(ggufs["per_head", "q8_0"], tmp_path / "f32.gguf")):
        llm = LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
        prompts = [prompt_for(llm.engine.loaded.config.vocab_size, n, seed=n) for n in (13, 6)]
        outputs.append([list(o.outputs[0].token_ids) for o in
                        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


# ------------------------------------------------------------------------------------------ bad files
def test_a_missing_selection_bias_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["per_head", "f32"], tmp_path / "bad.gguf", drop=("blk.2.exp_probs_b.bias",))
    with pytest.raises(CheckpointError, match=r"missing tensor blk\.2\.exp_probs_b\.bias \(the model's "
                                              r"layers\.2\.mlp\.experts\.e_score_correction_bias\)"):
        load_model(path)


def test_a_query_projection_not_of_its_layers_head_count_is_named(ggufs, tmp_path):
    wrong = np.zeros((64, 64), np.float32)  # layer 1 has 6 heads of 16: [96, 64]
    path = rewritten(ggufs["per_head", "f32"], tmp_path / "bad.gguf", tensors={"blk.1.attn_q.weight": (wrong, Q.F32)})
    with pytest.raises(CheckpointError, match=r"tensor blk\.1\.attn_q\.weight has shape \[64, 64\], but "
                                              r"laguna\.attention\.head_count\[1\] \(6\) .* make it \[96, 64\]"):
        load_model(path)


def test_a_gate_of_neither_width_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["per_head", "f32"], tmp_path / "bad.gguf", tensors={
        "blk.3.attn_gate.weight": (np.zeros((5, 64), np.float32), Q.F32)})
    with pytest.raises(CheckpointError, match=r"tensor blk\.3\.attn_gate\.weight has 5 rows, but "
                                              r"laguna\.attention\.head_count\[3\] \(8\) makes it 8 .* or 128"):
        load_model(path)


def test_an_expert_count_not_matching_the_tensors_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["per_head", "q8_0"], tmp_path / "bad.gguf", keys={"laguna.expert_count": 6})
    with pytest.raises(CheckpointError, match=r"tensor blk\.1\.ffn_gate_inp\.weight has shape \[8, 64\], but "
                                              r"laguna\.expert_count \(6\) .* make it \[6, 64\]"):
        load_model(path)


@pytest.mark.parametrize("drop, keys, message", [
    (("laguna.leading_dense_block_count",), None, r"required metadata key laguna\.leading_dense_block_count is missing"),
    ((), {"laguna.expert_gating_func": 4}, r"laguna\.expert_gating_func = 4 is not supported"),
    ((), {"laguna.attention.head_count": [4, 6, 2]}, r"laguna\.attention\.head_count has 3 entries for 4 layers"),
    ((), {"laguna.attention.sliding_window_pattern": [True]},
     r"laguna\.attention\.sliding_window_pattern should hold a boolean for each of the 4 layers"),
    ((), {"laguna.rope.dimension_count_swa": 17}, r"laguna\.rope\.dimension_count_swa \(17\) must be even"),
])
def test_bad_metadata_is_named(drop, keys, message, ggufs, tmp_path):
    path = rewritten(ggufs["per_head", "f32"], tmp_path / "bad.gguf", drop=drop, keys=keys)
    with pytest.raises((CheckpointError, UnsupportedError), match=message):
        load_model(path)


@pytest.mark.parametrize("changes, message", [
    ({"moe_apply_router_weight_on_input": True}, "moe_apply_router_weight_on_input has no GGUF key"),
    ({"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 1e4},
                          SLIDING: {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}},
     "RoPE scaling 'linear' on the sliding-window layers has no GGUF key"),
])
def test_what_llama_cpp_has_no_key_for_is_refused(changes, message, hf_dirs, tmp_path):
    hf = with_config(hf_dirs["per_head"], tmp_path, **changes)
    with pytest.raises(UnsupportedError, match=message):
        convert_hf_to_gguf(hf, tmp_path / "out.gguf", "f32")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial"))


def test_random_byte_flips_load_cleanly_or_fail_with_a_lucebox_error(ggufs, tmp_path):
    """Flips mostly in the header (the metadata this module reads): a clean load or a LuceboxError."""
    import random

    from lucebox.errors import LuceboxError
    from tests.mutations import parse_gguf
    from tests.weights.test_mutated_files import load_bounded
    valid = ggufs["per_head", "q8_0"].read_bytes()
    header_end = parse_gguf(valid).header_end
    rng = random.Random(2718)
    for i in range(30):
        data = bytearray(valid)
        span = header_end if rng.random() < 0.85 else len(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            data[int(rng.random() * span)] = rng.randrange(256)
        path = tmp_path / f"flip{i}.gguf"
        path.write_bytes(bytes(data))
        outcome, _, _ = load_bounded(path)
        assert not isinstance(outcome, Exception) or (isinstance(outcome, LuceboxError) and str(outcome)), i


# ------------------------------------------------------------------------------------------ tokenizer
def test_the_laguna_pre_tokenizer_and_turn_end_are_written_as_llama_cpp_reads_them(tokenizer_dir, tmp_path):
    """Laguna's tokenizer.json splits newline runs first, then with Qwen2's regex: tokenizer.ggml.pre
    "laguna" (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LAGUNA), rebuilt to tokenize as the HF tokenizer does;
    </assistant> (not special in tokenizer.json) is a control token, as llama.cpp's converter makes it."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from lucebox.text.gguf_vocab import NEWLINE_RUNS_REGEX, QWEN2_REGEX
    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(NEWLINE_RUNS_REGEX), behavior="isolated"),
                                                 pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.add_tokens(["</assistant>"])
    tok.save(str(tok_dir / "tokenizer.json"))
    hf_dir = build_laguna(tmp_path / "hf", tok_dir, **VARIANTS["per_head"])
    path = convert_hf_to_gguf(hf_dir, tmp_path / "t.gguf", "f32")
    fields = GGUFReader(path).fields
    assert fields["tokenizer.ggml.pre"].contents() == "laguna"
    turn_end = tok.token_to_id("</assistant>")
    assert fields["tokenizer.ggml.token_type"].contents()[turn_end] == TokenType.CONTROL
    ours, hf = load_model(str(path)).tokenizer, load_model(str(hf_dir)).tokenizer
    text = "def f(x):  \n\n    return x  \n  # it's 12345\r\n\ttab  </assistant> done \n"
    assert ours.encode(text) == hf.encode(text)
    # the newline runs are split first: "  \n\n" is two pieces, where Qwen2's regex alone keeps it whole
    pieces = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("x  \n\ny")]
    assert pieces == [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("x  \n\ny")] == ["x", "ĠĠ", "ĊĊ", "y"]
