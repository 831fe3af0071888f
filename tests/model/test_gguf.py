"""GGUF: the converter writes llama.cpp's layout, the loader reads it back to the same model, quantised
weights stay quantised and compute what their dequantised values compute, bad files fail clearly."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from lucebox.convert import convert_hf_to_gguf
from lucebox.errors import CheckpointError, LuceboxError, RequestError, UnsupportedError
from lucebox.model.gguf_config import to_our_name
from lucebox.model.loader import load_model
from lucebox.weights.quant import QuantEmbedding, QuantLinear

from tests.conftest import FAMILIES, build_hf_model
from tests.model.test_model import make_runner, prefill_logits, random_prompts
from tests.weights.test_quant import FP16_FIELDS, random_rows

GREEDY_TOKENS = 16
_loaded: dict = {}


@pytest.fixture(scope="module")
def gguf_f32(hf_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gguf")
    return {family: convert_hf_to_gguf(hf_models[family], out / f"{family}.gguf", "f32") for family in FAMILIES}


def cached_load(path, **kw):
    key = (str(path), tuple(sorted(kw.items())))
    if key not in _loaded:
        _loaded[key] = load_model(str(path), dtype="float32", **kw)
    return _loaded[key]


def greedy(loaded, prompt: list[int], steps: int = GREEDY_TOKENS) -> list[int]:
    runner, blocks = make_runner(loaded)
    table: list[int] = []
    blocks.allocate(table, len(prompt) + steps)
    logits, out = runner.forward([prompt], [0], [table]), []
    for pos in range(len(prompt), len(prompt) + steps):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([[out[-1]]], [pos], [table])
    return out


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows of "llama" models (HF rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rewrite_gguf(src, dst, *, arch=None, drop=(), tensors=None, reverse=False):
    """Copy a GGUF file, optionally changing the architecture, dropping metadata keys, replacing
    tensors ({name: (numpy array, GGUF type)}) or reversing the tensor order."""
    reader = GGUFReader(src)
    arch = arch or reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for t in reversed(reader.tensors) if reverse else reader.tensors:
        data, qtype = (tensors or {}).get(t.name, (np.array(t.data), t.tensor_type))
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ------------------------------------------------------------------------------------ float files

@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_logits_equal_the_hf_checkpoint_and_transformers(family, hf_models, gguf_f32):
    from transformers import AutoModelForCausalLM

    ours = cached_load(gguf_f32[family])
    assert ours.format == "gguf"
    hf = cached_load(hf_models[family])
    prompts = random_prompts(ours.config.vocab_size)
    reference = AutoModelForCausalLM.from_pretrained(hf_models[family], dtype=torch.float32)
    for prompt, got, expected in zip(prompts, prefill_logits(ours, prompts), prefill_logits(hf, prompts)):
        assert (got - expected).abs().max().item() <= 1e-5
        with torch.no_grad():
            truth = reference(torch.tensor([prompt])).logits[0]
        assert (got - truth).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_greedy_continuation_equals_the_hf_checkpoint(family, hf_models, gguf_f32):
    ours, hf = cached_load(gguf_f32[family]), cached_load(hf_models[family])
    for prompt in random_prompts(ours.config.vocab_size, seed=3)[:2]:
        assert greedy(ours, prompt) == greedy(hf, prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_equals_the_hf_config(family, hf_models, gguf_f32):
    ours, hf = cached_load(gguf_f32[family]).config, cached_load(hf_models[family]).config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rms_norm_eps", "max_position_embeddings", "qk_norm", "qkv_bias", "o_bias",
                  "mlp_bias", "tie_word_embeddings", "sliding_windows", "eos_token_ids"):
        assert getattr(ours, field) == getattr(hf, field), field


def test_gguf_tokenizer_encodes_and_templates_like_the_hf_tokenizer(hf_models, gguf_f32):
    ours, hf = cached_load(gguf_f32["qwen3"]).tokenizer, cached_load(hf_models["qwen3"]).tokenizer
    text = "def f(x):\n    return x * 2  # Über café 🙂 <|im_end|> 12345"
    assert ours.encode(text) == hf.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == \
        hf.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.eos_token_ids == hf.eos_token_ids


def test_llama_q_and_k_rows_are_stored_in_llama_cpp_order(hf_models, gguf_f32):
    from safetensors.torch import load_file

    hf = load_file(hf_models["llama"] / "model.safetensors")
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(gguf_f32["llama"]).tensors}
    assert torch.equal(stored["blk.0.attn_q.weight"], llama_cpp_permute(hf["model.layers.0.self_attn.q_proj.weight"], 4))
    assert torch.equal(stored["blk.1.attn_k.weight"], llama_cpp_permute(hf["model.layers.1.self_attn.k_proj.weight"], 2))
    assert torch.equal(stored["blk.0.attn_v.weight"], hf["model.layers.0.self_attn.v_proj.weight"])
    assert "rope_freqs.weight" in stored  # llama3 RoPE travels as frequency factors, as in llama.cpp


def test_qwen_q_rows_are_stored_unpermuted(hf_models, gguf_f32):
    from safetensors.torch import load_file

    hf = load_file(hf_models["qwen2"] / "model.safetensors")
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(gguf_f32["qwen2"]).tensors}
    assert torch.equal(stored["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(stored["blk.0.attn_q.bias"], hf["model.layers.0.self_attn.q_proj.bias"])


def test_qwen2_style_pre_tokenizer_is_named_qwen2_and_tokenizes_the_same(tokenizer_dir, tmp_path):
    import shutil

    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from lucebox.text.gguf_vocab import QWEN2_REGEX

    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save(str(tok_dir / "tokenizer.json"))
    hf_dir = build_hf_model("qwen2", tmp_path / "hf", tok_dir)
    path = convert_hf_to_gguf(hf_dir, tmp_path / "q.gguf", "f32")
    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "qwen2"
    ours, hf = load_model(str(path)).tokenizer, load_model(str(hf_dir)).tokenizer
    text = "x = 12345 + 678;\n\n  print('hello world')  # it's"
    assert ours.encode(text) == hf.encode(text)


@pytest.mark.parametrize("qtype,ggml_type", [("f16", Q.F16), ("bf16", Q.BF16)])
def test_half_precision_gguf_keeps_norms_and_biases_f32_and_stays_close(qtype, ggml_type, hf_models, tmp_path):
    path = convert_hf_to_gguf(hf_models["qwen2"], tmp_path / f"{qtype}.gguf", qtype)
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == ggml_type and types["token_embd.weight"] == ggml_type
    assert types["blk.0.attn_q.bias"] == Q.F32 and types["blk.0.attn_norm.weight"] == Q.F32
    ours, hf = load_model(str(path), dtype="float32"), cached_load(hf_models["qwen2"])
    prompts = random_prompts(ours.config.vocab_size)
    for got, expected in zip(prefill_logits(ours, prompts), prefill_logits(hf, prompts)):
        assert (got - expected).abs().max().item() <= 2e-2


# ------------------------------------------------------------------------------------ quantised files

def dequantised_reference(gguf_path, hf_dir):
    """A float lucebox model whose weights are gguf-py's dequantisation of the file's tensors."""
    reference = load_model(str(hf_dir), dtype="float32")
    cfg = reference.config
    reader = GGUFReader(gguf_path)
    permuted = reader.fields["general.architecture"].contents() == "llama"
    params = dict(reference.model.named_parameters())
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        shape = tuple(reversed(t.shape.tolist()))
        values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(shape)
        if permuted and ".attn_q." in t.name:
            values = llama_cpp_unpermute(values, cfg.num_heads)
        elif permuted and ".attn_k." in t.name:
            values = llama_cpp_unpermute(values, cfg.num_kv_heads)
        with torch.no_grad():
            params[to_our_name(t.name)].copy_(values)
    return reference


BLOCK_SCALE = {Q.Q4_K: 1e-4, Q.Q5_K: 5e-5, Q.Q6_K: 3e-5, Q.IQ4_NL: 5e-4, Q.IQ4_XS: 3e-5}


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_rows(qtype, rows, cols // block_size, rng)
    blocks = raw.reshape(-1, type_size)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(-BLOCK_SCALE[qtype], BLOCK_SCALE[qtype], (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8)
    return raw


def assert_stays_quantised(loaded, gguf_path):
    """QuantLinear/QuantEmbedding modules are in place and the model holds the file's bytes, no more."""
    model, cfg = loaded.model, loaded.config
    quant_linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant_linears) == 7 * cfg.num_layers + (0 if cfg.tie_word_embeddings else 1)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    in_file = sum(int(t.n_bytes) for t in GGUFReader(gguf_path).tensors if t.name != "rope_freqs.weight")
    assert held == in_file


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("qtype,family", [("q8_0", "llama-linear-bias"), ("q4_0", "llama"), ("q4_0", "qwen3"),
                                          ("q5_1", "qwen2")])
def test_quantised_gguf_computes_what_its_dequantised_weights_compute(qtype, family, fused, hf_models, tmp_path):
    path = convert_hf_to_gguf(hf_models[family], tmp_path / f"{family}-{qtype}.gguf", qtype)
    quantised = load_model(str(path), dtype="float32")
    assert_stays_quantised(quantised, path)
    if fused:  # as engines run it: q/k/v and gate/up as one quantised GEMV each, the same bytes held
        quantised.model.fuse_projections()
        layer = quantised.model.layers[0]
        assert layer.self_attn.qkv is not None and layer.mlp.gate_up is not None
        assert_stays_quantised(quantised, path)
    reference = dequantised_reference(path, hf_models[family])
    prompts = random_prompts(quantised.config.vocab_size)
    for got, expected in zip(prefill_logits(quantised, prompts), prefill_logits(reference, prompts)):
        assert (got - expected).abs().max().item() <= 1e-4


def test_k_quant_and_iq4_tensors_load_quantised_and_compute_their_dequantised_values(tokenizer_dir, tmp_path):
    # K-quant rows need 256-value blocks, so a wider model; gguf-py cannot quantise to these types,
    # so the blocks are random bytes with scales that give weights of a realistic size (~0.03).
    hf_dir = build_hf_model("llama", tmp_path / "hf", tokenizer_dir, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=1)
    f32 = convert_hf_to_gguf(hf_dir, tmp_path / "f32.gguf", "f32")
    rng = np.random.default_rng(0)
    kinds = {"token_embd.weight": Q.Q6_K, "output.weight": Q.IQ4_XS, "blk.0.attn_q.weight": Q.Q4_K,
             "blk.0.attn_k.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.attn_output.weight": Q.IQ4_NL,
             "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q5_K, "blk.0.ffn_down.weight": Q.Q6_K}
    replaced = {}
    for t in GGUFReader(f32).tensors:
        if t.name in kinds:
            rows, cols = reversed(t.shape.tolist())
            qtype = kinds[t.name]
            replaced[t.name] = (random_blocks(qtype, rows, cols, rng), qtype)
    path = rewrite_gguf(f32, tmp_path / "kquants.gguf", tensors=replaced)
    quantised = load_model(str(path), dtype="float32")
    assert_stays_quantised(quantised, path)
    reference = dequantised_reference(path, hf_dir)
    prompts = random_prompts(quantised.config.vocab_size)
    for got, expected in zip(prefill_logits(quantised, prompts), prefill_logits(reference, prompts)):
        assert (got - expected).abs().max().item() <= 1e-4


def test_quantised_model_runs_in_bfloat16(hf_models, tmp_path):
    path = convert_hf_to_gguf(hf_models["qwen3"], tmp_path / "q8.gguf", "q8_0")
    low, full = load_model(str(path), dtype="bfloat16"), load_model(str(path), dtype="float32")
    assert low.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.bfloat16
    prompts = random_prompts(low.config.vocab_size)
    for got, expected in zip(prefill_logits(low, prompts), prefill_logits(full, prompts)):
        assert (got - expected).abs().max().item() <= 0.1 * expected.abs().max().item()


def test_quantised_embedding_dequantises_only_the_rows_it_looks_up(hf_models, tmp_path, monkeypatch):
    from lucebox.kernels import dequant

    path = convert_hf_to_gguf(hf_models["qwen3"], tmp_path / "q8.gguf", "q8_0")
    embed = load_model(str(path), dtype="float32").model.embed_tokens
    seen = []
    real = dequant.dequantize
    monkeypatch.setattr(dequant, "dequantize", lambda data, *a, **k: seen.append(data.shape) or real(data, *a, **k))
    ids = torch.tensor([[3, 7, 3]])
    out = embed(ids)
    assert out.shape == (1, 3, 64) and seen == [(3, embed.qweight.shape[1])]
    assert torch.equal(out[0, 0], embed.weight.dequantize()[3])


def test_tensor_order_in_the_file_does_not_matter(hf_models, tmp_path):
    # Biases then arrive after their quantised weight module has been swapped in.
    path = convert_hf_to_gguf(hf_models["llama-linear-bias"], tmp_path / "q8.gguf", "q8_0")
    shuffled = rewrite_gguf(path, tmp_path / "reversed.gguf", reverse=True)
    prompts = random_prompts(387)
    for got, expected in zip(prefill_logits(load_model(str(shuffled), dtype="float32"), prompts),
                             prefill_logits(load_model(str(path), dtype="float32"), prompts)):
        assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------ converter


def test_generation_config_sampling_values_become_generation_defaults(hf_models, tmp_path):
    import json
    import shutil

    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_models["qwen3"], hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    path = convert_hf_to_gguf(hf_dir, tmp_path / "g.gguf", "f32")
    assert load_model(str(path)).generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}

def test_converter_rejects_an_unknown_output_type(hf_models, tmp_path):
    with pytest.raises(RequestError, match="q3_k"):
        convert_hf_to_gguf(hf_models["qwen3"], tmp_path / "x.gguf", "q3_k")


def test_failed_conversion_leaves_no_file_behind(hf_models, tmp_path, monkeypatch):
    import lucebox.convert

    calls = []

    def failing(values, qtype):
        calls.append(qtype)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return gguf.quants.quantize(values, qtype)

    monkeypatch.setattr(lucebox.convert, "quantize", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_hf_to_gguf(hf_models["qwen3"], tmp_path / "out.gguf", "q8_0")
    assert list(tmp_path.iterdir()) == []
    # An OS error names the file; a file already there is left as it was.
    (tmp_path / "out.gguf").write_bytes(b"earlier")
    calls.clear()
    monkeypatch.setattr(lucebox.convert, "quantize", lambda values, qtype: (_ for _ in ()).throw(
        OSError(28, "No space left on device")))
    with pytest.raises(LuceboxError, match=r"out\.gguf: cannot write the GGUF file .*No space left"):
        convert_hf_to_gguf(hf_models["qwen3"], tmp_path / "out.gguf", "q8_0")
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"] and (tmp_path / "out.gguf").read_bytes() == b"earlier"


# ------------------------------------------------------------------------------------ bad files

@pytest.mark.parametrize("keep", [0.3, 0.99], ids=["in-header", "in-tensor-data"])
def test_truncated_gguf_raises_checkpoint_error_naming_the_file(keep, gguf_f32, tmp_path):
    data = gguf_f32["qwen3"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_model(str(path))


def test_corrupt_magic_raises_checkpoint_error(gguf_f32, tmp_path):
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGUX" + gguf_f32["qwen3"].read_bytes()[4:])
    with pytest.raises(CheckpointError, match="magic.gguf"):
        load_model(str(path))


def test_unknown_architecture_raises_unsupported_error_naming_it(gguf_f32, tmp_path):
    path = rewrite_gguf(gguf_f32["qwen3"], tmp_path / "arch.gguf", arch="falcon")
    with pytest.raises(UnsupportedError, match="falcon"):
        load_model(str(path))


def test_tensor_with_wrong_shape_raises_checkpoint_error_naming_it(gguf_f32, tmp_path):
    wrong = np.zeros((64, 96), dtype=np.float32)  # q_proj of qwen3 is [96, 64]
    path = rewrite_gguf(gguf_f32["qwen3"], tmp_path / "shape.gguf", tensors={"blk.1.attn_q.weight": (wrong, Q.F32)})
    with pytest.raises(CheckpointError, match=r"blk\.1\.attn_q\.weight"):
        load_model(str(path))


def test_missing_metadata_key_raises_checkpoint_error_naming_it(gguf_f32, tmp_path):
    path = rewrite_gguf(gguf_f32["qwen3"], tmp_path / "key.gguf", drop={"qwen3.block_count"})
    with pytest.raises(CheckpointError, match=r"qwen3\.block_count"):
        load_model(str(path))


def test_unsupported_tensor_type_raises_unsupported_error_naming_tensor_and_type(gguf_f32, tmp_path):
    raw = np.zeros((96, 84), dtype=np.uint8)  # one Q2_K block per row; the type is refused before the shape
    path = rewrite_gguf(gguf_f32["qwen3"], tmp_path / "q2k.gguf", tensors={"blk.0.attn_q.weight": (raw, Q.Q2_K)})
    with pytest.raises(UnsupportedError) as err:
        load_model(str(path))
    assert "blk.0.attn_q.weight" in str(err.value) and "Q2_K" in str(err.value)
