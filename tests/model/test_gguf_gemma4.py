"""GGUF `gemma4` as llama.cpp writes it: `lucebox convert` writes it (names from gguf's own tensor map,
llama.cpp's keys), the loader reads it back to what transformers computes (sliding/full layers with their
own head sizes and RoPE, KV-shared layers, k = v, per-layer inputs, double-wide MLPs, the MoE block),
Q8_0 files compute their gguf-dequantised values with the experts kept quantised, and bad files name the
tensor or key at fault."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

from lucebox.convert import convert_hf_to_gguf
from lucebox.errors import CheckpointError
from lucebox.model.loader import load_model
from lucebox.weights.quant import QuantLinear, QuantTensor
from tests.model.test_gemma4 import ROPE, WINDOW, build
from tests.gguf_files import copy_fields, dequantised_copy, finish, lucebox_logits, prompt_for, rewritten
from tests.model.test_qwen3_5 import reference_logits

S, F = "sliding_attention", "full_attention"
# 31B-like, in the form llama.cpp can read: the last two layers that keep K/V are sliding then full (llama.cpp
# gives shared sliding layers the one before last, shared full layers the last); k = v on full layers with
# their own head size and KV heads; per-layer inputs; double-wide MLPs on the shared layers.
DENSE = {"model_type": "gemma4_text", "num_hidden_layers": 8, "head_dim": 16, "global_head_dim": 32,
         "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": WINDOW,
         "layer_types": [S, S, F, S, F, S, S, F], "num_kv_shared_layers": 3, "hidden_size_per_layer_input": 8,
         "vocab_size": 400, "vocab_size_per_layer_input": 400,  # llama.cpp reads one vocabulary for both tables
         "use_double_wide_mlp": True, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
         "tie_word_embeddings": True, "rope_parameters": ROPE}
# 26B-A4B-like: the MoE block beside every dense MLP, a separate v on full layers, no sharing, an LM head.
MOE = {"model_type": "gemma4_text", "num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32,
       "sliding_window": WINDOW, "layer_types": [S, F, S, F], "hidden_size_per_layer_input": 0,
       "enable_moe_block": True, "num_experts": 6, "top_k_experts": 2, "moe_intermediate_size": 32,
       "final_logit_softcapping": 30.0, "tie_word_embeddings": False, "rope_parameters": ROPE}
SPECS = {"dense": DENSE, "moe": MOE}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    return {kind: build(tmp_path_factory, tokenizer_dir, f"gemma4-{kind}", spec) for kind, spec in SPECS.items()}


@pytest.fixture(scope="module")
def ggufs(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-gemma4")
    return {(kind, qtype): convert_hf_to_gguf(models[kind][0], out / f"{kind}-{qtype}.gguf", qtype)
            for kind in SPECS for qtype in ("f32", "q8_0")}


@pytest.mark.parametrize("kind", SPECS)
def test_f32_gguf_logits_equal_transformers(kind, ggufs, models):
    loaded = load_model(str(ggufs[kind, "f32"]), dtype="float32")
    prompt = prompt_for(loaded.config.vocab_size)  # 29 tokens: past the window of 5, in two chunks
    assert (lucebox_logits(loaded, prompt) - reference_logits(models[kind][1], prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", SPECS)
def test_gguf_config_equals_the_hf_config(kind, ggufs, models):
    ours, hf = load_model(str(ggufs[kind, "f32"])).config, load_model(str(models[kind][0])).config
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                  "sliding_windows", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layers",
                  "layer_types", "layer_head_dims", "layer_kv_heads", "kv_sources", "attention_k_eq_v",
                  "double_wide_mlp", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                  "final_logit_softcapping"):
        assert getattr(ours, field) == getattr(hf, field), field
    for layer_kind, rotary in hf.rotary.items():
        got = ours.rotary[layer_kind]
        assert got.rope.theta == rotary.rope.theta and int(got.fraction * 16) == int(rotary.fraction * 16)


@pytest.mark.parametrize("kind", SPECS)
def test_the_file_uses_gguf_s_own_names_and_llama_cpp_s_keys(kind, ggufs, models):
    """Every HF tensor the text model uses lands under the name gguf's GEMMA4 tensor map gives it."""
    from safetensors import safe_open
    path, cfg = models[kind][0], load_model(str(models[kind][0])).config
    reader = GGUFReader(ggufs[kind, "f32"])
    written = {t.name: np.array(t.data) for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, cfg.num_layers)
    renamed = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
    mapped = set()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for hf_name in f.keys():
            layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
            special = next((v for k, v in renamed.items() if hf_name.endswith(k)), None)
            # llama.cpp's converter names experts and layer_scalar as `.weight` tensors before mapping them
            suffixed = hf_name if hf_name.endswith(".weight") else hf_name + ".weight"
            name = f"blk.{layer}.{special}" if special else names.get_name(suffixed, try_suffixes=(".weight",))
            assert name is not None, hf_name
            if name not in written:  # only KV-shared layers' k/v, which transformers never uses either
                assert layer and cfg.kv_sources[int(layer)] != int(layer) and ".self_attn.k" in hf_name, hf_name
                continue
            assert np.array_equal(written[name], f.get_tensor(hf_name).numpy().reshape(written[name].shape)), name
            mapped.add(name)
    assert set(written) - mapped == {"rope_freqs.weight"}
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith("gemma4.")}
    full = np.array(written["rope_freqs.weight"])
    assert list(full) == [1.0] * 4 + [1e30] * 12  # a quarter of the 16 pairs of a 32-wide full head turn
    assert fields["gemma4.attention.sliding_window_pattern"] == [t == S for t in SPECS[kind]["layer_types"]]
    assert fields["gemma4.attention.key_length"] == 32 and fields["gemma4.attention.key_length_swa"] == 16
    assert fields["gemma4.rope.freq_base"] == 1e6 and fields["gemma4.rope.freq_base_swa"] == 1e4
    assert fields["gemma4.final_logit_softcapping"] == 30.0
    if kind == "dense":
        assert fields["gemma4.attention.shared_kv_layers"] == 3
        assert fields["gemma4.attention.head_count_kv"] == [2, 2, 1, 2, 1, 2, 2, 1]
        assert fields["gemma4.feed_forward_length"] == [128] * 5 + [256] * 3
        assert fields["gemma4.embedding_length_per_layer_input"] == 8
        assert "blk.2.attn_v.weight" not in written and "blk.1.attn_v.weight" in written  # k = v on full layers
    else:
        assert fields["gemma4.expert_count"] == 6 and fields["gemma4.expert_used_count"] == 2
        assert fields["gemma4.expert_feed_forward_length"] == 32 and "blk.3.ffn_gate_up_exps.weight" in written


@pytest.mark.parametrize("kind", SPECS)
def test_q8_0_gguf_keeps_weights_quantised_and_computes_its_dequantised_values(kind, ggufs, models, tmp_path):
    loaded = load_model(str(ggufs[kind, "q8_0"]), dtype="float32")
    layer = loaded.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    if kind == "moe":
        for layer in loaded.model.layers:  # stacked [E, 2I, H] raw Q8_0 rows
            assert isinstance(layer.experts.gate_up_proj, QuantTensor) and layer.experts.gate_up_proj.qtype == Q.Q8_0
            assert layer.experts.gate_up_proj.shape == (6, 64, 64) and layer.experts.down_proj.shape == (6, 64, 32)
    float_copy = load_model(str(dequantised_copy(ggufs[kind, "q8_0"], tmp_path / "f32.gguf")), dtype="float32")
    prompt = prompt_for(loaded.config.vocab_size, seed=2)
    got = lucebox_logits(loaded, prompt)
    assert (got - lucebox_logits(float_copy, prompt)).abs().max().item() <= 1e-4
    # Q8_0 moves these tiny models' logits by about their own size (normalised q and k at scale 1 make the
    # attention peaked), so the reference is transformers holding the same Q8_0-rounded (and F16) weights.
    assert (got - reference_logits(rounded_like_the_file(models[kind][1]), prompt)).abs().max().item() <= 1e-4


def rounded_like_the_file(reference):
    """A copy of the HF model whose matrices hold what convert's q8_0 writes: Q8_0 where rows are whole
    blocks, F16 otherwise, the router in F32."""
    import copy
    model = copy.deepcopy(reference)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or "router.proj" in name:
                continue
            if p.shape[-1] % 32:
                p.copy_(p.half().float())
            else:
                values = p.numpy().astype(np.float32)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, Q.Q8_0), Q.Q8_0)
                                         .reshape(values.shape)))
    return model


def test_a_conditional_generation_checkpoint_converts_to_the_same_text_model(models, ggufs, tmp_path, tokenizer_dir):
    """The published form (Gemma4ForConditionalGeneration, text model under model.language_model., a vision
    tower) gives the text model's file: the tower is left out, as llama.cpp's converter leaves it to mmproj."""
    import shutil

    from transformers import AutoConfig, Gemma4ForConditionalGeneration
    path, reference = models["dense"]
    text = {k: v for k, v in AutoConfig.from_pretrained(path).to_dict().items()
            if k not in ("architectures", "transformers_version", "dtype")}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4, "position_embedding_size": 16}
    model = Gemma4ForConditionalGeneration(AutoConfig.for_model("gemma4", text_config=text, vision_config=vision,
                                                                audio_config=None))
    assert not model.model.language_model.load_state_dict(reference.model.state_dict()).missing_keys
    model.save_pretrained(tmp_path / "hf")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, tmp_path / "hf" / file)
    written = convert_hf_to_gguf(tmp_path / "hf", tmp_path / "cg.gguf", "f32")
    want = {t.name: np.array(t.data) for t in GGUFReader(ggufs["dense", "f32"]).tensors}
    got = {t.name: np.array(t.data) for t in GGUFReader(written).tensors}
    assert got.keys() == want.keys() and all(np.array_equal(got[name], want[name]) for name in want)


def test_experts_with_gate_and_up_split_load_too(ggufs, models, tmp_path):
    """llama.cpp also reads ffn_gate_exps + ffn_up_exps (each [E, I, H]) where the converter writes them fused."""
    reader = GGUFReader(ggufs["moe", "q8_0"])
    writer = GGUFWriter(tmp_path / "split.gguf", "gemma4")
    copy_fields(reader, writer, skip=("general.architecture",))
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name.endswith("ffn_gate_up_exps.weight"):  # raw Q8_0 rows [E, 2I, row bytes]: gate rows, then up rows
            gate, up = np.split(data, 2, axis=1)
            writer.add_tensor(t.name.replace("gate_up", "gate"), np.ascontiguousarray(gate), raw_dtype=t.tensor_type)
            writer.add_tensor(t.name.replace("gate_up", "up"), np.ascontiguousarray(up), raw_dtype=t.tensor_type)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    finish(writer)
    split, fused = load_model(str(tmp_path / "split.gguf"), dtype="float32"), load_model(str(ggufs["moe", "q8_0"]))
    assert isinstance(split.model.layers[0].experts.gate_up_proj, QuantTensor)
    prompt = prompt_for(split.config.vocab_size, seed=3)
    assert torch.equal(lucebox_logits(split, prompt), lucebox_logits(fused, prompt))


# ------------------------------------------------------------------------------------------ bad files
def test_a_missing_tensor_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["dense", "f32"], tmp_path / "bad.gguf", drop=("blk.3.attn_k_norm.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor blk\.3\.attn_k_norm\.weight "
                                              r"\(the model's layers\.3\.self_attn\.k_norm\.weight\)"):
        load_model(path)


def test_a_wrong_shape_is_named(ggufs, tmp_path):
    reader = {t.name: t for t in GGUFReader(ggufs["dense", "f32"]).tensors}
    cut = np.array(reader["blk.2.attn_q.weight"].data)[:64]
    path = rewritten(ggufs["dense", "f32"], tmp_path / "bad.gguf", tensors={"blk.2.attn_q.weight": (cut, Q.F32)})
    with pytest.raises(CheckpointError, match=r"tensor blk\.2\.attn_q\.weight has shape \[64, 64\], but "
                                              r"gemma4\.\* .* make it \[128, 64\]"):
        load_model(path)


def test_expert_count_not_matching_the_tensors_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["moe", "q8_0"], tmp_path / "bad.gguf", keys={"gemma4.expert_count": 5})
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.ffn_down_exps\.scale has shape \[6\], but "
                                              r"gemma4\.expert_count \(5\) .* make it \[5\]"):
        load_model(path)


@pytest.mark.parametrize("drop, message", [
    ("gemma4.attention.sliding_window_pattern", r"required metadata key gemma4\.attention\.sliding_window_pattern"),
    ("gemma4.attention.key_length", r"required metadata key gemma4\.attention\.key_length is missing"),
    ("rope_freqs.weight", r"missing tensor rope_freqs\.weight"),
])
def test_missing_keys_are_named(drop, message, ggufs, tmp_path):
    with pytest.raises(CheckpointError, match=message):
        load_model(rewritten(ggufs["moe", "f32"], tmp_path / "bad.gguf", drop=(drop,)))


def test_a_pattern_of_the_wrong_length_is_named(ggufs, tmp_path):
    path = rewritten(ggufs["moe", "f32"], tmp_path / "bad.gguf",
                     keys={"gemma4.attention.sliding_window_pattern": [True, False]})
    with pytest.raises(CheckpointError, match=r"gemma4\.attention\.sliding_window_pattern should hold a boolean for "
                                              r"each of the 4 layers"):
        load_model(path)


def test_too_many_shared_kv_layers_are_named(ggufs, tmp_path):
    path = rewritten(ggufs["dense", "f32"], tmp_path / "bad.gguf", keys={"gemma4.attention.shared_kv_layers": 7})
    with pytest.raises(CheckpointError, match=r"gemma4\.attention\.shared_kv_layers \(7\)"):
        load_model(path)


@pytest.mark.parametrize("quant", ["q4_k_m", "iq4_xs"])
def test_k_quant_files_compute_their_gguf_dequantised_values(quant, tmp_path):
    """A gemma4 file in llama.cpp's Q4_K_M / IQ4_XS mixes (random blocks: bench/llama_cpp.py's peer file, Q6_K
    heads and ffn_down, the tied embedding and the fused experts quantised) computes what the same file
    dequantised by the gguf package computes, the experts kept as one QuantTensor each."""
    from lucebox.bench import llama_cpp, shapes
    path = tmp_path / f"{quant}.gguf"
    llama_cpp.write_gguf(shapes.shape_config("tiny-gemma4-moe"), quant, path)
    loaded = load_model(str(path), dtype="float32")
    experts = loaded.model.layers[0].experts
    assert isinstance(experts.gate_up_proj, QuantTensor) and isinstance(experts.down_proj, QuantTensor)
    assert experts.down_proj.qtype == (Q.Q6_K if quant == "q4_k_m" else Q.IQ4_XS)
    float_copy = load_model(str(dequantised_copy(path, tmp_path / "f32.gguf")), dtype="float32")
    prompt = prompt_for(loaded.config.vocab_size, seed=7)
    want = lucebox_logits(float_copy, prompt)
    assert (lucebox_logits(loaded, prompt) - want).abs().max().item() <= 1e-4 and want.std() > 0.1


def test_the_engine_generates_from_the_gguf_what_it_generates_from_the_checkpoint(models, ggufs):
    """Through the engine (chunked prefill past the window, KV-shared layers reading their source's cache,
    per-group block tables, a batch of two): the same greedy tokens from the F32 file as from the HF model."""
    from lucebox import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = []
    for path in (models["dense"][0], ggufs["dense", "f32"]):
        llm = LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
        prompts = [prompt_for(llm.engine.loaded.config.vocab_size, n, seed=n) for n in (13, 6)]
        outputs.append([list(o.outputs[0].token_ids) for o in
                        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
    assert outputs[0] == outputs[1]
