"""The fused kernels the model runs compute what their torch references compute.

- RoPE on q and k fused with the paged K/V write (kernels/rope.py, kernels/triton_rope_kv.py):
  bit-identical to apply_rope + PagedKVCache.write for every cache type (plain types written in
  place, quantised or rotated ones through the cache's own quantiser).
- Qwen3's per-head q/k norm folded into the RoPE kernel (the RMSNorm kernels: test_norm_kernels.py).
- silu(gate) * up in one pass (kernels/activation.py, kernels/triton_activation.py).
- (A decode token's GEMV with the op before it in its prologue: test_gemv_prologue.py.)
- A whole model forward with the fused path matches the reference path.

Without a GPU the kernels run under Triton's interpreter (set up by tests/test_triton_kernels.py,
imported first), on small shapes.
"""
from __future__ import annotations

import copy

import pytest
import torch

from lucebox.kernels import (  # noqa: E402
    activation,
    norm,
    rope,
    triton_activation,
    triton_norm,
    triton_rope_kv,  # noqa: E402
)
from lucebox.model.kv_cache import PagedKVCache  # noqa: E402

from tests.kernels.test_triton_kernels import DEVICE, rel_err  # noqa: I001  (sets TRITON_INTERPRET=1 first)

BLOCK_SIZE, NUM_BLOCKS = 4, 6


def rope_case(dtype, heads, kv_heads, head_dim, tokens, cache_types=("auto", "auto"), rotate_k=False,
              fused_qkv=False, gated_q=False, rotary=None, seed=0):
    """Inputs of one attention layer's rope+write step, caches pre-filled with noise, and slots
    scattered over non-contiguous blocks. rotary: the rotated width (partial rotary), else head_dim."""
    g = torch.Generator().manual_seed(seed)
    if fused_qkv:  # q, k, v as strided views of one projection output, as a fused qkv linear gives
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    elif gated_q:  # each head's query beside its output gate, as Qwen 3.5's q_proj yields them
        q = torch.randn(tokens, heads, 2 * head_dim, generator=g).to(DEVICE, dtype)[..., :head_dim]
        k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    else:
        q = torch.randn(tokens, heads, head_dim, generator=g).to(DEVICE, dtype)
        k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    angles = torch.rand(tokens, (rotary or head_dim) // 2, generator=g) * 6.3
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    caches = [PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, t, dtype, DEVICE, rotate=r)
              for t, r in zip(cache_types, (rotate_k, False))]
    every_slot = torch.arange(NUM_BLOCKS * BLOCK_SIZE, device=DEVICE)
    for cache in caches:
        cache.write(torch.randn(len(every_slot), kv_heads, head_dim, generator=g).to(DEVICE, dtype), every_slot)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:tokens].to(DEVICE)
    return q, k, v, cos, sin, caches[0], caches[1], slots


def cache_state(cache: PagedKVCache) -> list[torch.Tensor]:
    return [cache.values.view(torch.uint8)] + ([cache.scales] if cache.scales is not None else [])


def run_both(q, k, v, cos, sin, k_cache, v_cache, slots):
    """(reference q, reference caches, Triton q, Triton caches), each path on its own cache copies."""
    ref_caches, tri_caches = copy.deepcopy((k_cache, v_cache)), copy.deepcopy((k_cache, v_cache))
    want = rope.rope_and_write_kv_reference(q, k, v, cos, sin, *ref_caches, slots)
    got = triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, *tri_caches, slots)
    return want, ref_caches, got, tri_caches


ROPE_CASES = {
    # name: (dtype, heads, kv_heads, head_dim, tokens, extra rope_case kwargs)
    "f32-gqa": (torch.float32, 4, 2, 16, 5, {}),
    "bf16-group3-head-dim-48": (torch.bfloat16, 6, 2, 48, 7, {}),
    "f16-mha-one-token": (torch.float16, 4, 4, 32, 1, {}),
    "bf16-fused-qkv-views": (torch.bfloat16, 4, 2, 32, 3, {"fused_qkv": True}),
    "bf16-model-f32-k-f16-v": (torch.bfloat16, 4, 1, 32, 5, {"cache_types": ("f32", "f16")}),
    "bf16-q8_0-rotated-k-fp8-v": (torch.bfloat16, 4, 2, 32, 5, {"cache_types": ("q8_0", "fp8"), "rotate_k": True}),
    "f32-q4_0-k-plain-v": (torch.float32, 2, 2, 64, 3, {"cache_types": ("q4_0", "auto")}),
    "bf16-partial-rotary-quarter": (torch.bfloat16, 4, 2, 64, 5, {"rotary": 16}),
    "f32-partial-rotary-q8_0-k": (torch.float32, 2, 1, 32, 3, {"rotary": 24, "cache_types": ("q8_0", "auto")}),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_fused_rope_and_kv_write_is_bit_identical_to_rope_then_cache_write(case):
    dtype, heads, kv_heads, head_dim, tokens, kw = ROPE_CASES[case]
    inputs = rope_case(dtype, heads, kv_heads, head_dim, tokens, **kw)
    want, ref_caches, got, tri_caches = run_both(*inputs)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    for ref, tri in zip(ref_caches, tri_caches):
        for a, b in zip(cache_state(ref), cache_state(tri)):
            assert torch.equal(a, b)


QK_NORM_CASES = {
    # name: (dtype, heads, kv_heads, head_dim, tokens, norm weight dtype, extra rope_case kwargs)
    "f32": (torch.float32, 4, 2, 16, 5, torch.float32, {}),
    "bf16-fused-qkv-views": (torch.bfloat16, 4, 2, 32, 3, torch.bfloat16, {"fused_qkv": True}),
    "bf16-head-dim-48": (torch.bfloat16, 6, 2, 48, 4, torch.bfloat16, {}),
    "bf16-q8_0-k": (torch.bfloat16, 4, 2, 32, 4, torch.bfloat16, {"cache_types": ("q8_0", "auto")}),
    "f16-f32-weights-promote": (torch.float16, 4, 2, 32, 3, torch.float32, {}),
    # Qwen 3.5 gated attention: q a strided view beside its output gate, a quarter of each head turned
    "bf16-partial-rotary-gated-q": (torch.bfloat16, 4, 2, 64, 3, torch.bfloat16, {"rotary": 16, "gated_q": True}),
    "f32-partial-rotary": (torch.float32, 2, 2, 48, 4, torch.float32, {"rotary": 12}),
}


@pytest.mark.parametrize("case", list(QK_NORM_CASES))
def test_fused_qk_norm_matches_norm_then_rope_then_cache_write(case):
    # Qwen3 normalises each head of q and k before RoPE; the kernel does it in the same program.
    dtype, heads, kv_heads, head_dim, tokens, w_dtype, kw = QK_NORM_CASES[case]
    q, k, v, cos, sin, k_cache, v_cache, slots = rope_case(dtype, heads, kv_heads, head_dim, tokens, **kw)
    g = torch.Generator().manual_seed(1)
    q_w, k_w = ((1 + 0.2 * torch.randn(head_dim, generator=g)).to(DEVICE, w_dtype) for _ in range(2))
    qk_norm = (q_w, k_w, 1e-6)
    ref_caches, tri_caches = copy.deepcopy((k_cache, v_cache)), copy.deepcopy((k_cache, v_cache))
    want = rope.rope_and_write_kv_reference(q, k, v, cos, sin, *ref_caches, slots, qk_norm)
    got = triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, *tri_caches, slots, qk_norm)
    # The references, spelled out: the per-head norm, then the rotation.
    assert torch.equal(want, rope.apply_rope(norm.rms_norm_reference(q, q_w, 1e-6), cos, sin))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == want.dtype and got.shape == want.shape and rel_err(got, want) <= tol
    # Not a plain rotation: the norm changed the values.
    assert rel_err(want, rope.apply_rope(q, cos, sin)) > 0.05
    want_k = ref_caches[0].gather(slots, want.dtype)
    assert rel_err(tri_caches[0].gather(slots, want.dtype), want_k) <= (tol if kw.get("cache_types") is None else 5e-2)
    assert torch.equal(tri_caches[1].gather(slots, v.dtype), v)


@pytest.mark.parametrize("case", ["f32", "bf16-k-is-v", "bf16-q8_0-v"])
def test_gemma_v_norm_normalises_v_before_its_cache_write(case):
    """Gemma 4: v is RMS-normalised per head without a weight (its k_eq_v layers pass k's projection
    as v) in the same launch as the q/k norms, RoPE and the writes; a quantised V cache quantises
    the normalised rows."""
    dtype = torch.float32 if case == "f32" else torch.bfloat16
    kw = {"cache_types": ("auto", "q8_0")} if case == "bf16-q8_0-v" else {}
    q, k, v, cos, sin, k_cache, v_cache, slots = rope_case(dtype, 4, 2, 64, 3, **kw)
    if case == "bf16-k-is-v":
        v = k
    g = torch.Generator().manual_seed(2)
    q_w, k_w = ((1 + 0.2 * torch.randn(64, generator=g)).to(DEVICE, dtype) for _ in range(2))
    ref_caches, tri_caches = copy.deepcopy((k_cache, v_cache)), copy.deepcopy((k_cache, v_cache))
    want = rope.rope_and_write_kv_reference(q, k, v, cos, sin, *ref_caches, slots, (q_w, k_w, 1e-6), 1e-6)
    got = triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, *tri_caches, slots, (q_w, k_w, 1e-6), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got, want) <= tol
    want_v = norm.unit_rms_norm(v, 1e-6)
    assert rel_err(want_v, v) > 0.05  # the norm changed the values
    for ref, tri in zip(ref_caches, tri_caches):
        assert rel_err(tri.gather(slots, dtype), ref.gather(slots, dtype)) <= tol
    if case != "bf16-q8_0-v":
        assert rel_err(tri_caches[1].gather(slots, dtype), want_v) <= tol


def test_plain_caches_are_written_in_place_and_quantised_ones_through_their_quantiser():
    q, k, v, cos, sin, k_cache, v_cache, slots = rope_case(torch.float32, 2, 2, 32, 2, ("q8_0", "f32"))
    assert not triton_rope_kv.writes_in_place(k_cache) and triton_rope_kv.writes_in_place(v_cache)
    writes = []
    k_cache.write = lambda x, s, _real=k_cache.write: writes.append("k") or _real(x, s)
    v_cache.write = lambda x, s: pytest.fail("a plain V cache went through PagedKVCache.write")
    triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert writes == ["k"]


def test_padding_tokens_with_a_negative_slot_write_nothing():
    # A CUDA graph captured for more tokens than a step has pads with slot -1.
    q, k, v, cos, sin, k_cache, v_cache, slots = rope_case(torch.float16, 4, 2, 16, 3)
    slots[1] = -1
    before = [t.clone() for t in cache_state(k_cache) + cache_state(v_cache)]
    got = triton_rope_kv.rope_and_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got, rope.apply_rope(q, cos, sin))
    keep = (torch.arange(NUM_BLOCKS * BLOCK_SIZE, device=DEVICE) != slots[[0, 2], None]).all(0)
    for old, new in zip(before, cache_state(k_cache) + cache_state(v_cache)):
        assert torch.equal(old.flatten(0, 1)[keep], new.flatten(0, 1)[keep])
    want_k = rope.apply_rope(k, cos, sin)
    assert torch.equal(k_cache.gather(slots[[0, 2]], k.dtype), want_k[[0, 2]])
    assert torch.equal(v_cache.gather(slots[[0, 2]], v.dtype), v[[0, 2]])


def test_rope_dispatch_follows_the_switch(monkeypatch):
    inputs = rope_case(torch.float32, 2, 1, 16, 2)
    calls = []
    real = triton_rope_kv.rope_and_write_kv
    monkeypatch.setattr(triton_rope_kv, "rope_and_write_kv", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    rope.rope_and_write_kv(*inputs)
    assert calls == []
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    rope.rope_and_write_kv(*inputs)
    assert calls == [1]


def test_a_forward_decides_the_dispatch_once(monkeypatch):
    """Inside decided_once (a model forward) the switch is read once: a change of the environment
    takes effect at the next forward, not within one (reading it at every op cost ~3% of an eager
    decode step); outside, every call reads it."""
    from lucebox.kernels import dispatch
    inputs = rope_case(torch.float32, 2, 1, 16, 2)
    calls = []
    real = triton_rope_kv.rope_and_write_kv
    monkeypatch.setattr(triton_rope_kv, "rope_and_write_kv", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    with dispatch.decided_once():
        monkeypatch.setenv("LUCEBOX_TRITON", "1")
        rope.rope_and_write_kv(*inputs)
        assert calls == []
    rope.rope_and_write_kv(*inputs)
    assert calls == [1]


# ----------------------------------------------------------------------------- whole model

MODEL_CASES = {
    # name: (model dtype, K cache type, V cache type, rotate K, tolerance on the logits)
    "f32": (torch.float32, "auto", "auto", False, 1e-4),
    "bf16": (torch.bfloat16, "auto", "auto", False, 3e-2),
    "f32-q8_0-rotated-k": (torch.float32, "q8_0", "auto", True, 1e-4),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_a_model_forward_through_the_fused_kernels_matches_the_reference_path(monkeypatch, case):
    from lucebox.engine.block_manager import BlockManager
    from lucebox.engine.runner import ModelRunner
    from lucebox.engine.step_plan import StepPlan
    from lucebox.model.config import ModelConfig
    from lucebox.model.transformer import Transformer

    dtype, cache_k, cache_v, rotate_k, tol = MODEL_CASES[case]
    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True, sliding_windows=[None, 5])
    model = Transformer(cfg).to(DEVICE, dtype)
    calls = {"rope_kv": 0, "norm_residual": 0}
    for mod, name, key in ((triton_rope_kv, "rope_and_write_kv", "rope_kv"),
                           (triton_norm, "rms_norm_residual_triton", "norm_residual")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _key=key: calls.__setitem__(_key, calls[_key] + 1)
                            or _real(*a))

    def run_steps():
        runner = ModelRunner(model, 12, 4, cache_type_k=cache_k, cache_type_v=cache_v, rotate_k=rotate_k)
        blocks, tables = BlockManager(12, 4), [[], []]
        for table, n in zip(tables, (11, 9)):  # room for the prefill and the verify+decode step
            blocks.allocate(table, n)
        prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2]]
        first = runner.run(StepPlan.forward(prompts, [0, 0], tables, all_logits=True, capture_layers=(0,)))
        second = runner.forward([[6, 5, 3], [5]], [7, 5], tables, all_logits=True)
        return torch.cat([first.logits, second]), first.features

    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    want, want_taps = run_steps()
    assert calls == {"rope_kv": 0, "norm_residual": 0}
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    got, taps = run_steps()
    assert calls["rope_kv"] and calls["norm_residual"]  # any count: graph replay skips the Python launchers
    assert rel_err(got, want) <= tol and rel_err(taps, want_taps) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["fused-gate-up-views", "separate", "3d"])
def test_silu_and_mul_matches_the_reference(dtype, layout):
    g = torch.Generator().manual_seed(3)
    n = 1500  # more than one column block, not a power of two
    if layout == "fused-gate-up-views":  # column halves of one gate/up projection output
        gate, up = (4 * torch.randn(3, 2 * n, generator=g)).to(DEVICE, dtype).chunk(2, dim=-1)
    else:
        shape = (3, n) if layout == "separate" else (2, 2, n)
        gate, up = ((4 * torch.randn(*shape, generator=g)).to(DEVICE, dtype) for _ in range(2))
    got = triton_activation.silu_and_mul_triton(gate, up)
    want = activation.silu_and_mul_reference(gate, up)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(got, gate * up) > 0.1  # the activation is applied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rounded", [False, True], ids=["float", "rounded"])
@pytest.mark.parametrize("act, layout", [("sigmoid", "beside-queries"), ("softplus", "one-a-head"),
                                         ("softplus", "elementwise")])
def test_output_gates_read_their_gate_in_place_and_match_the_reference(dtype, rounded, act, layout):
    """act(gate) * o before o_proj. Qwen 3.5: q_proj yields [query | gate] per head, the sigmoid gate
    a strided view; Laguna: softplus of one value a head (expanded along head_dim) or of every
    element. The kernel reads each in place, rounding as the reference (and its rows for int8)."""
    g = torch.Generator().manual_seed(4)
    tokens, heads, head = 3, 4, 64
    x = torch.randn(tokens, heads * head, generator=g).to(DEVICE, dtype)
    if layout == "beside-queries":
        q_and_gate = (4 * torch.randn(tokens, heads, 2 * head, generator=g)).to(DEVICE, dtype)
        gate, other = q_and_gate[..., head:], q_and_gate[..., :head]
    elif layout == "one-a-head":  # a column slice of a fused projection, one value a head
        proj = (4 * torch.randn(tokens, heads + 8, generator=g)).to(DEVICE, dtype)
        gate, other = (t.unsqueeze(-1).expand(tokens, heads, head) for t in (proj[:, 8:], proj[:, :heads]))
    else:
        gate = (4 * torch.randn(tokens, heads, head, generator=g)).to(DEVICE, dtype)
        other = gate.flip(-1)
    got, rows = triton_activation.output_gate_triton(gate, x, act, rounded)
    want = activation.output_gate_reference(gate, x, act)
    if act == "sigmoid":
        assert torch.equal(want, x * torch.sigmoid(gate.reshape(tokens, -1)))
    assert got.dtype == want.dtype and got.shape == (tokens, heads * head)
    assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(got, activation.output_gate_reference(other, x, act)) > 0.1  # that gate, not another
    if rounded:  # the bytes quantize_rows makes of the output
        from lucebox.kernels import triton_dp4a
        assert torch.equal(rows, triton_dp4a.quantize_rows(got))
    else:
        assert rows is None
    with pytest.raises(ValueError, match="does not gate"):
        triton_activation.output_gate_triton(gate, x[:, :head], act)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # -> inf, as on GPUs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_tanh_and_mul_matches_the_reference_and_rounds_its_rows(dtype):
    """Gemma's GeGLU activation on the same kernel: gelu (tanh approximation) as torch computes it,
    and its rows rounded to int8 as quantize_rows does."""
    from lucebox.kernels import triton_dp4a
    g = torch.Generator().manual_seed(6)
    gate, up = (3 * torch.randn(2, 2, 768, generator=g)).to(DEVICE, dtype).unbind(0)  # 768: two column blocks
    got, rows = triton_activation.gated_act_triton(gate, up, "gelu_tanh", rounded=True)
    want = activation.gelu_tanh_and_mul_reference(gate, up)
    assert got.dtype == want.dtype and rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(got, torch.nn.functional.silu(gate) * up) > 0.01  # not silu
    assert torch.equal(rows, triton_dp4a.quantize_rows(got))


def test_silu_and_mul_dispatch_follows_the_switch(monkeypatch):
    gate, up = torch.randn(2, 64).to(DEVICE), torch.randn(2, 64).to(DEVICE)
    calls = []
    real = triton_activation.silu_and_mul_triton
    monkeypatch.setattr(triton_activation, "silu_and_mul_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("LUCEBOX_TRITON", "0")
    activation.silu_and_mul(gate, up)
    assert calls == []
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    activation.silu_and_mul(gate, up)
    assert calls == [1]
