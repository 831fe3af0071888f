"""KV cache storage types: round-trip error bounds, llama.cpp/gguf bit-compatibility, paging."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from lucebox.errors import RequestError
from lucebox.kernels import kv_quant
from lucebox.model.kv_cache import CACHE_TYPES, PagedKVCache, parse_cache_type

H, D = 4, 128
OUTLIER_CHANNELS = (3, 45, 70)  # a few channels much larger than the rest, as real keys have


def make_keys(tokens: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, D, generator=g)
    x[..., list(OUTLIER_CHANNELS)] *= 20
    return x


def round_trip(x: torch.Tensor, cache_type: str, rotate: bool = False) -> torch.Tensor:
    cache = PagedKVCache(4, 16, H, D, cache_type, torch.float32, "cpu", rotate=rotate)
    slots = torch.arange(x.shape[0])
    cache.write(x, slots)
    return cache.gather(slots, torch.float32)


def block_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-value block: amax in float32 and x reshaped to [..., D/32, 32]."""
    b = x.reshape(*x.shape[:-1], D // 32, 32)
    return b.abs().amax(-1), b


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16"])
def test_float_types_round_trip_within_half_an_ulp(cache_type):
    x = make_keys()
    err = (round_trip(x, cache_type) - x).abs()
    fi = torch.finfo({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[cache_type])
    # round to nearest: |err| <= eps/2 * |x|; below the smallest normal the spacing stops shrinking.
    assert (err <= fi.eps / 2 * x.abs().clamp(min=fi.tiny)).all()


def test_fp8_error_is_within_e4m3_rounding_of_row_amax():
    x = make_keys()
    err = (round_trip(x, "fp8") - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3 has 3 mantissa bits: rounding to nearest costs <= 2^-4 * |x| <= 2^-4 * row amax.
    assert (err <= 2 ** -4 * amax).all()


def test_q8_0_error_is_within_half_a_step_per_block():
    x = make_keys()
    q, d16 = kv_quant.quantize_q8_0(x)
    err = (kv_quant.dequantize_q8_0(q, d16) - x).reshape(*x.shape[:-1], D // 32, 32).abs()
    amax, _ = block_scales(x)
    d32 = amax / 127
    # round(x/d) is off by <= d/2; storing d as fp16 adds |q| * |d - d16| with |q| <= 127;
    # multiplying by float32 1/d instead of dividing adds a few float32 ulps (the 1e-5 slack).
    bound = d32 / 2 + 127 * (d32 - d16.float()).abs() + 1e-5 * d32
    assert (err <= bound.unsqueeze(-1)).all()
    # i.e. amax/127/2, loosened by the fp16 scale's relative error 2^-11 times |q| <= 127
    assert (err <= (amax / 127 * (0.5 + 127 * 2 ** -11 + 1e-5)).unsqueeze(-1)).all()


def test_q4_0_error_is_within_one_step_per_block():
    x = make_keys()
    p, d16 = kv_quant.quantize_q4_0(x)
    err = (kv_quant.dequantize_q4_0(p, d16) - x).reshape(*x.shape[:-1], D // 32, 32).abs()
    amax, _ = block_scales(x)
    d32 = amax / 8
    # |d| = amax/8 and the largest-magnitude value maps exactly to q=0. Rounding costs <= |d|/2,
    # except a value near -max (scaled +8) which must clip from 16 to 15: <= |d|. fp16 storage of d
    # adds |q-8| * |d - d16| with |q-8| <= 8.
    bound = d32 + 8 * (d32 - d16.float().abs()).abs() + 1e-5 * d32
    assert (err <= bound.unsqueeze(-1)).all()


def gguf_edge_cases() -> torch.Tensor:
    """Random rows plus rows that hit rounding ties, zero blocks and +-max magnitude ties."""
    x = make_keys(32).reshape(-1, D)
    ties = torch.zeros(4, D)
    ties[0, :32] = torch.arange(32) - 15.5  # x/d lands on .5 for q8_0 once amax is rescaled
    ties[0, 0] = 127.0                        # d = 1: every half-integer is an exact tie
    ties[1, :32] = torch.tensor([3.0, -3.0] * 16)  # q4_0: first of equal magnitudes sets the sign
    ties[2, :32] = (torch.arange(32) - 16) * 0.5   # max -8 -> d = 1: values at x.5 for trunc(+8.5)
    # row 3 stays all zero: d = 0 must give zeros, not NaN
    return torch.cat([x, ties])


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_q_types_match_gguf_bit_for_bit(name):
    x = gguf_edge_cases()
    qtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[name]
    quant = {"q8_0": kv_quant.quantize_q8_0, "q4_0": kv_quant.quantize_q4_0}[name]
    dequant = {"q8_0": kv_quant.dequantize_q8_0, "q4_0": kv_quant.dequantize_q4_0}[name]
    ref_blocks = gguf_quantize(x.numpy(), qtype)
    q, d = quant(x)
    # ggml block = fp16 d (little endian) then the 32 (q8_0) or 16 packed (q4_0) quant bytes
    ours = torch.cat([d.unsqueeze(-1).view(torch.uint8),
                      q.view(torch.uint8).reshape(x.shape[0], D // 32, -1)], dim=-1).reshape(x.shape[0], -1)
    np.testing.assert_array_equal(ours.numpy(), ref_blocks)
    np.testing.assert_array_equal(dequant(q, d).numpy(), gguf_dequantize(ref_blocks, qtype))


@pytest.mark.parametrize("n", [128, 64, 96, 80])
def test_hadamard_is_orthonormal(n):
    h = kv_quant.hadamard_matrix(n, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    b = kv_quant.hadamard_block_size(n)  # 96 -> 32, 80 -> 16: block-diagonal
    assert torch.allclose(h[:b, :b].abs(), torch.full((b, b), b ** -0.5, dtype=torch.float64))


def test_rotation_is_invisible_to_gather():
    x = make_keys()
    torch.testing.assert_close(round_trip(x, "f32", rotate=True), x, atol=1e-5, rtol=1e-5)


def test_rotation_lowers_q4_0_error_on_outlier_channels():
    x = make_keys()
    rms = {r: (round_trip(x, "q4_0", rotate=r) - x).pow(2).mean().sqrt().item() for r in (False, True)}
    # Without rotation an outlier sets d for its block and crushes its 31 neighbours to ~0.
    assert rms[True] < 0.6 * rms[False], rms


def reference_round_trip(x: torch.Tensor, cache_type: str) -> torch.Tensor:
    if cache_type in ("f32", "f16", "bf16"):
        return x.to({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[cache_type]).float()
    quant = {"fp8": kv_quant.quantize_fp8, "q8_0": kv_quant.quantize_q8_0, "q4_0": kv_quant.quantize_q4_0}
    dequant = {"fp8": kv_quant.dequantize_fp8, "q8_0": kv_quant.dequantize_q8_0,
               "q4_0": kv_quant.dequantize_q4_0}
    return dequant[cache_type](*quant[cache_type](x))


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16", "fp8", "q8_0", "q4_0"])
def test_write_gather_through_shuffled_block_table(cache_type):
    num_blocks, block_size, n = 8, 4, 19
    cache = PagedKVCache(num_blocks, block_size, H, D, cache_type, torch.float32, "cpu")
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))[:5]
    pos = torch.arange(n)
    slots = table[pos // block_size] * block_size + pos % block_size
    x = make_keys(n)
    cache.write(x[:13], slots[:13])  # a prefill chunk, then the rest, as the engine would
    cache.write(x[13:], slots[13:])
    assert torch.equal(cache.gather(slots, torch.float32), reference_round_trip(x, cache_type))
    pick = torch.tensor([18, 0, 7, 12])
    assert torch.equal(cache.gather(slots[pick], torch.float32), reference_round_trip(x[pick], cache_type))
    unused = [b for b in range(num_blocks) if b not in table.tolist()]
    assert not cache.values[unused].view(torch.uint8).any()


@pytest.mark.parametrize("cache_type", ["bf16", "fp8", "q4_0"])
def test_copy_blocks_copies_values_and_scales(cache_type):
    cache = PagedKVCache(6, 4, H, D, cache_type, torch.float32, "cpu", rotate=True)
    x = make_keys(8)
    cache.write(x, torch.arange(8))  # blocks 0 and 1
    cache.copy_blocks(torch.tensor([1, 0]), torch.tensor([4, 5]))
    assert torch.equal(cache.gather(torch.arange(16, 24), torch.float32),
                       cache.gather(torch.tensor([4, 5, 6, 7, 0, 1, 2, 3]), torch.float32))


@pytest.mark.parametrize("cache_type,per_value", [
    ("f32", 4), ("f16", 2), ("bf16", 2), ("auto", 2),  # auto = the model's bf16
    ("fp8", 1 + 4 / D), ("q8_0", 34 / 32), ("q4_0", 18 / 32)])
def test_bytes_per_token_includes_scales(cache_type, per_value):
    cache = PagedKVCache(2, 4, H, D, cache_type, torch.bfloat16, "cpu")
    assert cache.bytes_per_token == H * D * per_value
    stored = cache.values.nbytes + (cache.scales.nbytes if cache.scales is not None else 0)
    assert stored == cache.bytes_per_token * 2 * 4  # the layout really is that size


def test_auto_resolves_to_model_dtype():
    assert parse_cache_type("auto", torch.float16) == "f16"
    assert parse_cache_type("BF16", torch.float32) == "bf16"
    assert set(CACHE_TYPES) >= {"auto", "f32", "f16", "bf16", "fp8", "q8_0", "q4_0"}


def test_unknown_cache_type_is_a_request_error_naming_it():
    with pytest.raises(RequestError, match=r"--cache-type-v 'q5_k'.*q8_0, q4_0"):
        parse_cache_type("q5_k", torch.float16, flag="--cache-type-v")
    with pytest.raises(RequestError, match="int3"):
        PagedKVCache(2, 4, H, D, "int3", torch.float16, "cpu")


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_block_types_need_head_dim_multiple_of_32(cache_type):
    with pytest.raises(RequestError, match=rf"{cache_type}.*head_dim is 80"):
        PagedKVCache(2, 4, H, 80, cache_type, torch.float16, "cpu")
    with pytest.raises(RequestError, match=cache_type):
        getattr(kv_quant, f"quantize_{cache_type}")(torch.zeros(2, 80))


def test_error_table(capsys):
    """Documents quality: error per element relative to its (token, head) row amax, keys with outliers."""
    x = make_keys()
    amax = x.abs().amax(-1, keepdim=True)
    rows = []
    for cache_type in ("f32", "f16", "bf16", "fp8", "q8_0", "q4_0"):
        for rotate in ((False, True) if cache_type in ("fp8", "q8_0", "q4_0") else (False,)):
            rel = (round_trip(x, cache_type, rotate) - x).abs() / amax
            cache = PagedKVCache(1, 1, H, D, cache_type, torch.float32, "cpu")
            rows.append((cache_type + ("+rot" if rotate else ""), cache.bytes_per_token / (H * D),
                         rel.mean().item(), rel.max().item()))
    with capsys.disabled():
        print(f"\n{'cache type':<11}{'bytes/val':>10}{'mean err/amax':>15}{'max err/amax':>14}")
        for name, bpv, mean, mx in rows:
            print(f"{name:<11}{bpv:>10.4f}{mean:>15.2e}{mx:>14.2e}")
    by_name = {r[0]: r for r in rows}
    assert by_name["f16"][2] < by_name["fp8"][2] < by_name["q4_0"][2]
    assert by_name["q8_0"][2] < by_name["q4_0"][2]
