"""Quantised GGUF weights: bit-exact dequantisation against gguf-py, QuantTensor, QuantLinear."""
import numpy as np
import pytest
import torch
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from lucebox.errors import CheckpointError, UnsupportedError
from lucebox.kernels import dequant
from lucebox.weights.quant import SUPPORTED_TYPES, QuantLinear, QuantTensor

ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.name)
# gguf-py can quantise these; the others only dequantise, so their blocks are random bytes.
QUANTISABLE = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
# Byte offsets of the fp16 scale fields inside one block.
FP16_FIELDS = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0], Q.IQ4_XS: [0],
}


def finite_bits(bits: np.ndarray, exponent: int, clear: int) -> np.ndarray:
    """Turn Inf/NaN bit patterns into finite ones by clearing one exponent bit."""
    keep = np.array(~clear & np.iinfo(bits.dtype).max, dtype=bits.dtype)
    return np.where(bits & exponent == exponent, bits & keep, bits)


def random_rows(qtype, rows: int, blocks_per_row: int, rng, small_scales=False) -> np.ndarray:
    """Random GGUF bytes [rows, bytes_per_row] with every float field finite: random full-range
    fp16 scales (subnormals included), or small ones to give weights of a realistic magnitude."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    if qtype == Q.F32:
        raw = finite_bits(raw.view(np.uint32), 0x7F800000, 1 << 30).view(np.uint8)
    elif qtype == Q.F16:
        raw = finite_bits(raw.view(np.uint16), 0x7C00, 1 << 14).view(np.uint8)
    elif qtype == Q.BF16:
        raw = finite_bits(raw.view(np.uint16), 0x7F80, 1 << 14).view(np.uint8)
    for off in FP16_FIELDS.get(qtype, []):
        field = np.ascontiguousarray(raw[:, off:off + 2]).view(np.uint16)
        raw[:, off:off + 2] = finite_bits(field, 0x7C00, 1 << 14).view(np.uint8)
        if small_scales:
            small = rng.uniform(-0.01, 0.01, size=(raw.shape[0], 1)).astype(np.float16)
            raw[:, off:off + 2] = small.view(np.uint8)
    return raw.reshape(rows, -1)


def quantised_rows(qtype, rows: int, blocks_per_row: int, rng) -> np.ndarray:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    values = rng.standard_normal((rows, blocks_per_row * block_size)).astype(np.float32)
    return np.ascontiguousarray(gguf_quantize(values, qtype)).view(np.uint8)


def reference(raw: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32))


def test_supported_types_are_exactly_the_documented_set():
    assert SUPPORTED_TYPES == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                               Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_against_gguf(qtype):
    rng = np.random.default_rng(qtype.value)
    make = quantised_rows if qtype in QUANTISABLE else random_rows
    raw = make(qtype, 6, 4, rng)
    ours = dequant.dequantize(torch.from_numpy(raw), qtype)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, reference(raw, qtype))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_on_random_bytes(qtype):
    # Random bytes reach every code (e.g. -128 in Q8_0, all-ones scales) that quantize() avoids.
    raw = random_rows(qtype, 5, 3, np.random.default_rng(1000 + qtype.value))
    ours = dequant.dequantize(torch.from_numpy(raw), qtype)
    assert not torch.isnan(ours).any()
    assert torch.equal(ours, reference(raw, qtype))


def test_dequantize_keeps_leading_dims_and_casts_to_out_dtype():
    raw = random_rows(Q.Q4_K, 6, 2, np.random.default_rng(0)).reshape(2, 3, -1)
    data = torch.from_numpy(raw)
    full = dequant.dequantize(data, Q.Q4_K)
    assert full.shape == (2, 3, 512)
    assert torch.equal(dequant.dequantize(data, Q.Q4_K, torch.bfloat16), full.to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_on_cuda_matches_cpu_bit_for_bit(qtype):
    data = torch.from_numpy(random_rows(qtype, 4, 2, np.random.default_rng(7)))
    assert torch.equal(dequant.dequantize(data.cuda(), qtype).cpu(), dequant.dequantize(data, qtype))


def test_dequantize_rejects_unsupported_type_by_name():
    with pytest.raises(UnsupportedError, match="Q2_K"):
        dequant.dequantize(torch.zeros(1, 84, dtype=torch.uint8), Q.Q2_K)


def test_quant_tensor_from_reader_output_has_logical_shape_and_dequantizes():
    raw = random_rows(Q.Q6_K, 3, 2, np.random.default_rng(3))
    qt = QuantTensor.from_numpy(raw, Q.Q6_K, gguf_shape=[512, 3], name="blk.0.ffn_down.weight")
    assert qt.shape == (3, 512)
    assert qt.nbytes == raw.size
    assert torch.equal(qt.dequantize(), reference(raw, Q.Q6_K))


def test_quant_tensor_accepts_float_arrays_for_f32_and_f16():
    values = np.random.default_rng(4).standard_normal((2, 8)).astype(np.float16)
    qt = QuantTensor.from_numpy(values, Q.F16, gguf_shape=[8, 2], name="t")
    assert torch.equal(qt.dequantize(), torch.from_numpy(values.astype(np.float32)))


def test_quant_tensor_round_trips_through_a_real_gguf_file(tmp_path):
    raw = quantised_rows(Q.Q8_0, 4, 2, np.random.default_rng(5))
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output.weight", raw, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    qt = QuantTensor.from_reader_tensor(tensor)
    assert qt.shape == (4, 64) and qt.name == "output.weight"
    assert torch.equal(qt.dequantize(), reference(raw, Q.Q8_0))


def test_wrong_bytes_per_row_raises_checkpoint_error_naming_the_tensor():
    raw = np.zeros((4, 34 * 2 - 1), dtype=np.uint8)
    with pytest.raises(CheckpointError, match="blk.3.attn_q.weight"):
        QuantTensor.from_numpy(raw, Q.Q8_0, gguf_shape=[64, 4], name="blk.3.attn_q.weight")


def test_row_length_not_a_multiple_of_block_size_raises_checkpoint_error():
    with pytest.raises(CheckpointError, match="odd.weight"):
        QuantTensor.from_numpy(np.zeros((2, 34), np.uint8), Q.Q8_0, gguf_shape=[40, 2], name="odd.weight")


def test_unknown_type_raises_unsupported_error_naming_type_and_tensor():
    with pytest.raises(UnsupportedError) as err:
        QuantTensor.from_numpy(np.zeros((1, 66), np.uint8), Q.IQ2_XXS, [256, 1], name="blk.0.attn_k.weight")
    assert "IQ2_XXS" in str(err.value) and "blk.0.attn_k.weight" in str(err.value)


def make_linear(qtype, out_features, blocks_per_row, bias=False, **kw):
    raw = random_rows(qtype, out_features, blocks_per_row, np.random.default_rng(11), small_scales=True)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    qt = QuantTensor.from_numpy(raw, qtype, [blocks_per_row * block_size, out_features], name="w")
    b = torch.randn(out_features) if bias else None
    return QuantLinear(qt, b, **kw), qt.dequantize(), b


def close(actual, expected):
    # Chunked and whole matmuls may sum in different orders; only rounding may differ.
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_quant_linear_chunked_forward_matches_dense_matmul(monkeypatch):
    layer, w, _ = make_linear(Q.Q4_0, 10, 2, chunk_bytes=3 * 64 * 4)  # 3 rows per chunk
    calls = []
    real = dequant.dequantize
    monkeypatch.setattr(dequant, "dequantize", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    x = torch.randn(2, 5, 64)
    close(layer(x), x @ w.T)
    assert [s[0] for s in calls] == [3, 3, 3, 1]


def test_quant_linear_unchunked_forward_matches_dense_matmul():
    layer, w, _ = make_linear(Q.Q8_0, 6, 2)
    x = torch.randn(3, 64)
    close(layer(x), x @ w.T)


@pytest.mark.parametrize("chunk_bytes", [64 * 4, 32 << 20], ids=["chunked", "whole"])
def test_quant_linear_adds_bias(chunk_bytes):
    layer, w, b = make_linear(Q.Q6_K, 5, 1, bias=True, chunk_bytes=chunk_bytes)
    x = torch.randn(4, 256)
    close(layer(x), x @ w.T + b)


def test_quant_linear_output_follows_input_dtype():
    layer, w, _ = make_linear(Q.IQ4_NL, 4, 2)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, x @ w.to(torch.bfloat16).T)


def test_quant_linear_keeps_weight_quantised_as_a_buffer():
    layer, _, _ = make_linear(Q.Q5_K, 4, 1)
    layer.to(torch.float64)  # float casts must not touch the raw bytes
    assert dict(layer.named_buffers())["qweight"].dtype == torch.uint8
    assert layer.weight.shape == (4, 256)


def test_a_gpu_dequantises_whole_projections_a_cpu_its_chunks():
    from lucebox.kernels.linear import GPU_DEQUANT_BYTES, dequant_chunk_rows
    assert dequant_chunk_rows(3 * 64 * 4, 64, torch.device("cpu")) == 3
    # an 8B shape's gate_up (24,576 x 4,096) in two launches of dequantised rows, not twelve
    assert dequant_chunk_rows(32 << 20, 4096, torch.device("cuda", 0)) == GPU_DEQUANT_BYTES // (4 * 4096) == 16384
