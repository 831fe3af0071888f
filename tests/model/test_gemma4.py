"""Gemma 4 text models compute what transformers computes: interleaved sliding-window (windows
shorter than the prompts) and full-attention layers with their own head sizes and RoPE
(proportional on full layers), k = v on full layers, KV-shared layers reading an earlier layer's
cache, per-layer inputs, double-wide MLPs, the MoE block, soft-capped logits; through one-shot
prefill, unaligned chunks, decode, batches, greedy generation in the engine, and the
ConditionalGeneration checkpoint form."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:  # before any Triton import; see test_triton_kernels.py
    os.environ["TRITON_INTERPRET"] = "1"

from lucebox import LLM, SamplingParams  # noqa: E402
from lucebox.engine.block_manager import BlockManager  # noqa: E402
from lucebox.engine.runner import ModelRunner  # noqa: E402
from lucebox.errors import CheckpointError  # noqa: E402
from lucebox.model.cache_spec import PagedKVSpec, SharedKVSpec  # noqa: E402
from lucebox.model.loader import load_model  # noqa: E402
from tests.conftest import build_hf_model  # noqa: E402
from tests.model.test_qwen3_5 import prompts, reference_logits  # noqa: E402

BLOCK_SIZE = 4
WINDOW = 5
gpu = pytest.mark.skipif(not ON_GPU, reason="captures CUDA graphs")
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
         "sliding_attention", "full_attention"]
# 31B-like: k = v on full layers with their own head size and KV heads; the last 3 layers share KV;
# per-layer inputs; double-wide MLPs on the shared layers.
DENSE = {"model_type": "gemma4_text", "num_hidden_layers": 7, "head_dim": 16, "global_head_dim": 32,
             "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": WINDOW, "layer_types": TYPES,
             "num_kv_shared_layers": 3, "hidden_size_per_layer_input": 8, "use_double_wide_mlp": True,
             "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
             "rope_parameters": ROPE}
# 26B-A4B-like: the MoE block beside every dense MLP, separate v on full layers, no sharing.
MOE = {"model_type": "gemma4_text", "num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32, "sliding_window": WINDOW,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
           "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 6, "top_k_experts": 2,
           "moe_intermediate_size": 24, "final_logit_softcapping": 30.0, "tie_word_embeddings": False, "rope_parameters": ROPE}


def build(tmp_path_factory, tokenizer_dir, name, spec):
    path = build_hf_model("qwen3", tmp_path_factory.mktemp(name), tokenizer_dir, **spec)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the learned scalars and router scales away from 1, so a mix-up cannot hide
        for name_, p in model.named_parameters():
            if name_.endswith(("router.scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tokenizer_dir):
    return build(tmp_path_factory, tokenizer_dir, "gemma4", DENSE)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tokenizer_dir):
    return build(tmp_path_factory, tokenizer_dir, "gemma4_moe", MOE)


def runner_for(loaded, num_blocks: int = 96):
    return ModelRunner(loaded.model, num_blocks, BLOCK_SIZE), BlockManager(num_blocks, BLOCK_SIZE)


def prefill_error(loaded, reference, lengths, seed=1) -> float:
    batch = prompts(loaded.config.vocab_size, lengths, seed)
    runner, blocks = runner_for(loaded)
    tables = [[] for _ in batch]
    for table, prompt in zip(tables, batch):
        blocks.allocate(table, len(prompt))
    logits = runner.forward(batch, [0] * len(batch), tables, all_logits=True).cpu()
    worst, start = 0.0, 0
    for prompt in batch:
        got = logits[start:start + len(prompt)]
        worst = max(worst, (got - reference_logits(reference, prompt)).abs().max().item())
        start += len(prompt)
    return worst


def test_layers_and_cache_specs_follow_the_config(dense):
    loaded = load_model(str(dense[0]), dtype="float32")
    cfg = loaded.config
    assert cfg.family == "gemma4" and cfg.kv_sources == [0, 1, 2, 3, 2, 3, 2]
    assert cfg.double_wide_mlp == [False] * 4 + [True] * 3
    specs = loaded.model.cache_specs()
    assert [type(s) for s in specs] == [PagedKVSpec] * 4 + [SharedKVSpec] * 3
    assert [s.window for s in specs] == [WINDOW, WINDOW, None, WINDOW, None, WINDOW, None]
    assert (specs[2].num_kv_heads, specs[2].head_dim, specs[0].num_kv_heads, specs[0].head_dim) == (1, 32, 2, 16)
    assert [s.source for s in specs[4:]] == [2, 3, 2]
    assert loaded.model.layers[2].self_attn.v_proj is None  # k = v on full layers
    runner, _ = runner_for(loaded)
    assert len(runner.caches) == 4  # KV-shared layers allocate nothing


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_batched_prefill_matches_transformers(which, request):
    path, reference = request.getfixturevalue(which)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    assert prefill_error(loaded, reference, [3, 23, 11]) <= 1e-4  # windows of 5 inside 23 tokens


@gpu
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_cuda_prefill_and_decode_match_transformers(which, request):
    """The same on a GPU (Triton attention, norms and RoPE where they apply), float32, TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, reference = request.getfixturevalue(which)
    loaded = load_model(str(path), dtype="float32", device="cuda")
    prompt = prompts(loaded.config.vocab_size, [23], seed=7)[0]
    runner, blocks = runner_for(loaded)
    table = []
    blocks.allocate(table, len(prompt))
    rows = [runner.forward([prompt[:17]], [0], [table], all_logits=True)]
    rows += [runner.forward([[t]], [17 + i], [table], all_logits=True) for i, t in enumerate(prompt[17:])]
    got = torch.cat(rows).cpu()
    assert (got - reference_logits(reference, prompt)).abs().max().item() <= 1e-3


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_fused_layers_on_the_triton_kernels_match_transformers(which, request, monkeypatch):
    """After the engine's fuse_projections: the MoE layer's three FFN input norms in one launch and its
    post-norms with the residual add and layer scalar in another; the dense layers' scalar in their
    last add (Triton interpreted on the CPU, float32, TF32 off on a GPU)."""
    pytest.importorskip("triton")
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set")
    torch.backends.cuda.matmul.allow_tf32 = False
    from tests.model.test_laguna_graphs import count_calls
    path, reference = request.getfixturevalue(which)
    loaded = load_model(str(path), dtype="float32", device="cuda" if ON_GPU else "cpu")
    loaded.model.fuse_projections()
    calls = count_calls(monkeypatch, ("kernels.triton_norm", "rms_norm_many_triton"),
                        ("kernels.triton_norm", "rms_norm_pair_add_triton"), ("kernels.triton_norm", "rms_norm_add_triton"))
    monkeypatch.setenv("LUCEBOX_TRITON", "1")
    assert prefill_error(loaded, reference, [9, 6]) <= (1e-3 if ON_GPU else 1e-4)
    layers = loaded.config.num_layers
    if which == "moe":  # per layer: the post-attention add, then the fused FFN
        assert calls == {"rms_norm_many_triton": layers, "rms_norm_pair_add_triton": layers,
                         "rms_norm_add_triton": layers}
    else:  # post-attention, post-FFN and per-layer-input adds (the scalar in the last)
        assert calls == {"rms_norm_many_triton": 0, "rms_norm_pair_add_triton": 0, "rms_norm_add_triton": 3 * layers}


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_chunked_prefill_and_decode_match_transformers(which, request):
    """Unaligned chunks and single-token decodes, two sequences stepping together (one mid-prefill,
    one decoding), past the sliding window."""
    path, reference = request.getfixturevalue(which)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    a, b = prompts(loaded.config.vocab_size, [29, 17], seed=3)
    runner, blocks = runner_for(loaded)
    table_a, table_b = [], []
    blocks.allocate(table_a, len(a))
    blocks.allocate(table_b, len(b))
    rows_a, rows_b, pos_a, pos_b = [], [], 0, 0
    for step_a, step_b in ((7, 1), (1, 3), (6, 1), (1, 1), (3, 6), (1, 1), (9, 3), (1, 1)):
        step_b = min(step_b, len(b) - pos_b)
        out = runner.forward([a[pos_a:pos_a + step_a], b[pos_b:pos_b + step_b]], [pos_a, pos_b], [table_a, table_b],
                             all_logits=True)
        rows_a.append(out[:step_a])
        rows_b.append(out[step_a:])
        pos_a, pos_b = pos_a + step_a, pos_b + step_b
    assert (pos_a, pos_b) == (len(a), len(b))
    assert (torch.cat(rows_a) - reference_logits(reference, a)).abs().max().item() <= 1e-4
    assert (torch.cat(rows_b) - reference_logits(reference, b)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_greedy_generation_in_a_continuous_batch_equals_transformers(which, request):
    """Both stop at the end-of-sequence token where greedy decoding meets it (min_new_tokens in
    transformers would mask it instead, which ignore_eos does not). The second round extends the
    first round's prompts, so its prefixes come from the prefix cache: max_num_seqs 6 for 3 prompts sizes
    the window pools with room beside the running windows, where the prompts' windows stay cached (a pool
    of exactly the running windows recycles them under load, by design)."""
    path, reference = request.getfixturevalue(which)
    llm = LLM(str(path), block_size=BLOCK_SIZE, max_num_batched_tokens=8, max_num_seqs=6, kv_cache_memory=64 << 20)
    eos = set(llm.engine.loaded.config.eos_token_ids)
    first = prompts(llm.engine.loaded.config.vocab_size, [13, 6, 9], seed=4)
    blocks = llm.engine.scheduler.cache.blocks
    for batch in (first, [p + [5] for p in first]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=8))
        for prompt, out in zip(batch, outs):
            with torch.no_grad():
                want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
            got = list(out.outputs[0].token_ids)
            assert [t for t in got if t not in eos] == [t for t in want.tolist() if t not in eos]
            assert len(got) == len(want)
    assert blocks.hits > 0


def test_conditional_generation_checkpoint_loads_the_text_model(tmp_path, tokenizer_dir, dense, caplog):
    from transformers import AutoConfig, Gemma4ForConditionalGeneration
    path, reference = dense
    text = {k: v for k, v in AutoConfig.from_pretrained(path).to_dict().items()
            if k not in ("architectures", "transformers_version", "dtype")}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4, "position_embedding_size": 16}
    config = AutoConfig.for_model("gemma4", text_config=text, vision_config=vision, audio_config=None)
    model = Gemma4ForConditionalGeneration(config).eval()
    result = model.model.language_model.load_state_dict(reference.model.state_dict())
    assert not result.missing_keys
    model.save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, tmp_path / file)
    with caplog.at_level("INFO", logger="lucebox"):
        loaded = load_model(str(tmp_path), dtype="float32")
    skipped = [r.getMessage() for r in caplog.records if "vision/audio tower" in r.getMessage()]
    assert len(skipped) == 1, skipped
    assert loaded.config.family == "gemma4" and loaded.config.num_layers == 7
    assert prefill_error(loaded, reference, [12], seed=6) <= 1e-4


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_missing_tensor_is_named(tmp_path, dense):
    from safetensors.torch import load_file, save_file
    path = _copy(dense[0], tmp_path / "m")
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.3.post_feedforward_layernorm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.3\.post_feedforward_layernorm\.weight"):
        load_model(str(path), dtype="float32", device="cpu")


def test_a_wrong_shape_is_named(tmp_path, dense):
    from safetensors.torch import load_file, save_file
    path = _copy(dense[0], tmp_path / "m")
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.q_proj\.weight has shape \[64, 64\]"):
        load_model(str(path), dtype="float32", device="cpu")


def test_a_bad_expert_count_is_named(tmp_path, moe):
    path = _copy(moe[0], tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["num_experts"] = 5
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"layers\.0\.experts\.gate_up_proj has shape \[6, 48, 64\]"):
        load_model(str(path), dtype="float32", device="cpu")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_padded_static_decode_and_verify_batches_give_the_eager_logits(dense, device):
    """The batches a CUDA graph replays (GraphSettings(capture=False) runs them eagerly on the CPU,
    padding and device-only attention included; on CUDA real graphs are captured): both RoPE tables
    reserved, shared-KV layers reading their source's blocks, windows shorter than the contexts."""
    from lucebox.engine.graph_settings import GraphSettings
    from lucebox.engine.step_plan import PlanRow, RowKind, StepPlan
    loaded = load_model(str(dense[0]), dtype="float32", device=device)
    runner, blocks = runner_for(loaded)
    runner.attach_graphs(GraphSettings(64, max_batch=4, query_lens=(1, 4), capture=device == "cuda"))
    vocab = loaded.config.vocab_size
    starts = [11, 14, 9]
    tables = []
    for n in starts:
        tables.append([])
        blocks.allocate(tables[-1], n + 4)
    runner.run_eager(StepPlan.forward(prompts(vocab, starts, seed=3), [0] * 3, tables))
    rows, offset = [], 0
    for i, (tokens, start, table, kind) in enumerate(zip(prompts(vocab, [1, 4, 3], seed=4), starts, tables,
                                                         [RowKind.DECODE, RowKind.VERIFY, RowKind.VERIFY])):
        rows.append(PlanRow(tokens, start, table, kind, offset=offset, index=i))
        offset += len(tokens)
    plan = StepPlan(rows, all_logits=True)
    want = runner.run_eager(plan).logits
    got = runner.run(plan).logits
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-5
    assert all(table.cos.shape[0] >= 64 for table in loaded.model.rope.values())
    assert runner.graphs is not None


def test_shared_kv_layers_cost_no_cache_bytes(dense):
    from lucebox.model.cache_spec import kv_bytes_per_token
    model = load_model(str(dense[0]), dtype="float32").model
    own = [layer.self_attn for layer in model.layers[:4]]
    assert kv_bytes_per_token(model) == sum(2 * a.num_kv_heads * a.head_dim * 4 for a in own)


@pytest.mark.parametrize("spec", [
    {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 32},
    {"attention_k_eq_v": False, "num_global_key_value_heads": 1, "global_head_dim": 32},  # no KV override
    {"num_kv_shared_layers": 4, "use_double_wide_mlp": True},  # global_head_dim: transformers' default 512
    {"layer_types": None},  # transformers' default pattern (5 sliding : 1 full), last forced full
    {"layer_types": ["sliding_attention"] * 8},  # last forced full
])
def test_published_config_fields_read_as_transformers_reads_them(spec):
    """config.json as the published checkpoints write it (global_head_dim, num_global_key_value_heads;
    no per_layer_config): per-layer sizes, KV sources and MLP widths as transformers derives them."""
    from transformers import Gemma4TextConfig

    from lucebox.model.config import ModelConfig
    raw = dict({"model_type": "gemma4_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 4}, **spec)
    ours = ModelConfig.from_hf_dict(raw)
    theirs = Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    layers = range(theirs.num_hidden_layers)
    assert ours.layer_types == theirs.layer_types
    assert ours.layer_head_dims == [theirs.per_layer_config[i].head_dim for i in layers]
    assert ours.layer_kv_heads == [theirs.per_layer_config[i].num_key_value_heads for i in layers]
    # transformers before kv_sharing_modes (5.17) shared the last num_kv_shared_layers layers' KV, as it still does
    first_shared = theirs.num_hidden_layers - theirs.num_kv_shared_layers
    reuse = ([m == "reuse" for m in theirs.kv_sharing_modes] if hasattr(type(theirs), "kv_sharing_modes")
             else [i >= first_shared for i in layers])
    assert [source != i for i, source in enumerate(ours.kv_sources)] == reuse
    assert ours.double_wide_mlp == [theirs.use_double_wide_mlp and r for r in reuse]
    assert ours.sliding_windows == [theirs.sliding_window if t == "sliding_attention" else None
                                    for t in theirs.layer_types]
