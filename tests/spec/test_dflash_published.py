"""DFlash drafters for the Qwen 3.5 / 3.6 hybrids in their published layout (z-lab's
`Qwen3.6-27B-DFlash` config keys at a tiny scale): `rope_parameters` instead of `rope_theta`, the
hybrid vocabulary's mask token, sliding layers that are causal inside the block, bf16 tensors
without prefix. The drafter computes what z-lab's reference implementation (PyPI `dflash`, its
`DFlashDraftModel` over transformers' Qwen3 modules) computes, and drafts for a hybrid target."""
from __future__ import annotations

import json

import pytest
import torch

from lucebox import LLM, SamplingParams
from lucebox.errors import CheckpointError
from lucebox.model.config import ModelConfig
from lucebox.spec.dflash import DFlashProposer
from lucebox.spec.dflash2_model import read_config
from tests.conftest import build_hf_model
from tests.model.test_qwen3_5 import BLOCK_SIZE, HYBRID

BLOCK, WINDOW, TAPS = 16, 6, [0, 2]


def published_config(target: ModelConfig, **changes) -> dict:
    """The key set of z-lab/Qwen3.6-27B-DFlash's config.json, shrunk to the tiny target."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16", "block_size": BLOCK,
        "dflash_config": {"mask_token_id": target.vocab_size - 2, "target_layer_ids": TAPS},
        "num_target_layers": target.num_layers, "hidden_size": target.hidden_size, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW, "use_sliding_window": True,
        "max_position_embeddings": 262144, "vocab_size": target.vocab_size, "tie_word_embeddings": False,
        "use_cache": True, "transformers_version": "4.57.3",
    } | changes


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    return build_hf_model("qwen3", tmp_path_factory.mktemp("hybrid_target"), tokenizer_dir, **HYBRID)


def write_reference_drafter(target, out, **changes):
    """A random DFlashDraftModel of z-lab's reference code, saved as published: config.json and
    bf16 safetensors whose names carry no prefix."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config
    raw = published_config(ModelConfig.from_hf_dir(target), **changes)
    torch.manual_seed(3)
    model = DFlashDraftModel(Qwen3Config(**raw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "config.json").write_text(json.dumps(raw))  # exactly the published keys
    return out


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    pytest.importorskip("dflash.model")
    return write_reference_drafter(target, tmp_path_factory.mktemp("published_dflash"))


def test_the_published_config_reads_as_the_reference_does(drafter_dir, target):
    from safetensors import safe_open
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names and "embed_tokens.weight" not in names
    cfg = read_config(drafter_dir)
    t = ModelConfig.from_hf_dir(target)
    assert cfg.target_layer_ids == TAPS and cfg.mask_token_id == t.vocab_size - 2 and cfg.block_size == BLOCK
    assert cfg.num_target_layers == t.num_layers
    assert cfg.model.rope.theta == 1e7 and cfg.model.rope.type == "default"
    assert cfg.model.sliding_windows == [WINDOW, None] and cfg.causal_layers == [True, False]
    assert cfg.model.partial_rotary_factor == 1.0


TARGET_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
               "mrope_section": [2, 1, 1], "mrope_interleaved": True}  # a Qwen3.5 target's, copied
YARN = {"rope_type": "yarn", "rope_theta": 10000000.0, "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("changes", [{}, {"is_causal": False}, {"is_causal": True},
                                     {"rope_parameters": TARGET_ROPE}, {"rope_parameters": YARN}],
                         ids=["published", "is_causal false", "is_causal true", "target's rope keys", "yarn"])
def test_block_hidden_states_equal_the_reference_drafter(target, tmp_path, changes):
    """Context features at positions 0..a-1 and the block [anchor, MASK x 15] at a..a+15: the
    drafter's normed hidden states equal DFlashDraftModel's (float32, 1e-5), whichever layers
    `is_causal` makes causal, with the sliding layer's window shorter than the block, and whatever
    rope keys the drafter copied from its target (the reference turns the whole head)."""
    pytest.importorskip("dflash.model")
    from dflash.model import DFlashDraftModel
    path = write_reference_drafter(target, tmp_path / "d", **changes)
    reference = DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    proposer = DFlashProposer.load(str(path), LLM(str(target), block_size=BLOCK_SIZE).engine.loaded)
    drafter = proposer.drafter.float()
    causal = changes.get("is_causal")
    assert [layer.self_attn.causal for layer in drafter.layers] == ([True, False] if causal is None else [causal] * 2)
    g = torch.Generator().manual_seed(0)
    anchor, hidden = 23, drafter.config.model.hidden_size  # past yarn's original 16 positions
    features = torch.randn(anchor, len(TAPS) * hidden, generator=g)
    block = torch.randn(BLOCK, hidden, generator=g)  # stands for the target's embedding of the block
    with torch.no_grad():
        want = reference(position_ids=torch.arange(anchor + BLOCK)[None], noise_embedding=block[None],
                         target_hidden=features[None])[0]
        positions = torch.arange(anchor, anchor + BLOCK)
        context = drafter.context_kv(features, torch.arange(anchor))
        got = drafter.blocks(block, positions, context, torch.arange(anchor))
    assert (got - want).abs().max().item() <= 1e-5


def test_a_published_drafter_speculates_losslessly_on_a_hybrid(target, drafter_dir):
    """Loaded through the engine against the hybrid target: greedy output equals plain decoding."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = [{"prompt_token_ids": [5 + i, 9, 17, 30 + i, 2 * i + 1]} for i in range(3)]
    plain = [o.outputs[0].token_ids for o in LLM(str(target), block_size=BLOCK_SIZE).generate(batch, params,
                                                                                               use_tqdm=False)]
    config = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(str(target), block_size=BLOCK_SIZE, speculative_config=config)
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("change, message", [
    ({"is_causal": "yes"}, "is_causal"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "fast"}}, "rope_theta"),
    ({"layer_types": ["sliding_attention"]}, "layer_types has 1 entries for 2 layers"),
])
def test_bad_published_keys_are_named(target, tmp_path, change, message):
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(published_config(ModelConfig.from_hf_dir(target), **change)))
    with pytest.raises(CheckpointError, match=message):
        read_config(out)


@pytest.mark.parametrize("is_causal", [None, False])
def test_gguf_form_keeps_windows_and_causality(target, tmp_path, is_causal):
    """convert-drafter writes the published drafter as GGUF: sliding layers, the window and an
    explicit is_causal come back, and it computes what the safetensors drafter computes."""
    pytest.importorskip("dflash.model")
    from lucebox.spec.dflash import load_drafter
    from lucebox.spec.dflash_gguf import convert_drafter_to_gguf
    path = write_reference_drafter(target, tmp_path / "d", **({} if is_causal is None else {"is_causal": False}))
    gguf = convert_drafter_to_gguf(path, tmp_path / "d.gguf", "f16")
    st, _ = load_drafter(path, torch.float32, "cpu")
    gg, _ = load_drafter(gguf, torch.float32, "cpu")
    assert gg.config.is_causal == is_causal and gg.config.causal_layers == st.config.causal_layers
    assert gg.config.model.sliding_windows == [WINDOW, None]
    g = torch.Generator().manual_seed(2)
    features = torch.randn(9, len(TAPS) * st.config.model.hidden_size, generator=g)
    block = torch.randn(BLOCK, st.config.model.hidden_size, generator=g)
    with torch.no_grad():
        a, b = (d.blocks(block, torch.arange(9, 9 + BLOCK), d.context_kv(features, torch.arange(9)), torch.arange(9))
                for d in (st, gg))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
