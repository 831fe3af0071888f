"""DFlash drafters for Gemma 4 (and Laguna) targets, against the published reference.

Reference: PyPI `dflash` 0.1.0 (z-lab's DFlashDraftModel / dflash_generate, its Qwen3 modules over
transformers) for the drafter and its logits -- the target's LM head times `output_multiplier`,
soft-capped by the *drafter's* `final_logit_softcapping` (z-lab's Gemma 4 drafter carries 30, its
target's value), the MLP per `hidden_act`. For the block input, z-lab's original loop and training
code: the target's embedding module (transformers' Gemma 4 scales rows by sqrt(hidden), as vLLM's
and Lucebox's C++ Gemma 4 drafters do), unless the config sets `input_embedding_scale`, which 0.1.0
applies to raw rows. Per-layer inputs are the target's own. Mask token 4 as z-lab's Gemma 4 drafter.
Drafter training (`lucebox train-drafter`) on these targets: their taps, one step, the same rows."""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from lucebox import LLM
from tests.model.test_qwen3_5 import BLOCK_SIZE, prompts
from tests.spec.test_spec_gemma4_laguna import K, greedy

# ---------------------------------------------------------------------------------------------------
# The drafter against the published reference (PyPI dflash 0.1.0) on a Gemma 4 target

GEMMA_MASK = 4  # Gemma 4's mask token id (z-lab's Gemma 4 drafters; Lucebox's feature map)
GEMMA_TAPS = [0, 2, 5]  # a sliding layer, a full one and a KV-shared one


def gemma_drafter_config(target, **changes) -> dict:
    """The keys of z-lab's Gemma 4 drafter config (sliding layers then a full one, the target's logit
    soft-cap, mask token 4), at the tiny target's width."""
    t = json.loads((target / "config.json").read_text())
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": K + 1,
            "dflash_config": {"mask_token_id": GEMMA_MASK, "target_layer_ids": GEMMA_TAPS},
            "num_target_layers": t["num_hidden_layers"], "hidden_size": t["hidden_size"], "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6, "use_sliding_window": True,
            "final_logit_softcapping": 30.0, "max_position_embeddings": 256, "vocab_size": t["vocab_size"],
            "tie_word_embeddings": True} | changes


def write_reference_drafter(target, out, dtype=torch.float32, **changes):
    """A random DFlashDraftModel of the reference code, saved as published (float32 unless `dtype`)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config
    raw = gemma_drafter_config(target, **changes)
    torch.manual_seed(3)
    model = DFlashDraftModel(Qwen3Config(**raw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def reference_draft_logits(target_model, drafter, tokens: list[int], k: int) -> torch.Tensor:
    """dflash_generate's draft step: the taps of every committed position, the block [anchor, MASK..]
    embedded, the drafter, then its compute_logits over the target's LM head. The block embedding:
    with input_embedding_scale, 0.1.0's raw rows times it; without, z-lab's original loop and training
    code's `target.model.embed_tokens(ids)` (transformers' Gemma 4: scaled by sqrt(hidden)), which
    0.1.0 replaced by raw rows -- what the Gemma 4 drafters were not trained on."""
    from dflash.model import (
        _draft_value,
        _output_head,
        _raw_input_embeddings,
        extract_context_feature,
    )
    anchor = len(tokens) - 1
    with torch.no_grad():
        hidden = target_model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        features = extract_context_feature(hidden, drafter.target_layer_ids)
        block = torch.tensor([[tokens[-1]] + [drafter.mask_token_id] * (drafter.block_size - 1)])
        scale = _draft_value(drafter.config, "input_embedding_scale")
        embedded = target_model.get_input_embeddings()(block) if scale is None else \
            _raw_input_embeddings(target_model, block, float(scale))
        out = drafter(target_hidden=features, noise_embedding=embedded,
                      position_ids=torch.arange(anchor + drafter.block_size)[None])
        return drafter.compute_logits(out[0, 1:1 + k], _output_head(target_model))


@pytest.mark.parametrize("changes", [
    {},
    {"final_logit_softcapping": 0.5, "output_multiplier": 40.0},  # a cap and a multiplier that bite
    {"input_embedding_scale": 2.0, "final_logit_softcapping": None},  # raw rows times the config's scale
    {"hidden_act": "gelu_pytorch_tanh", "is_causal": False},
], ids=["published", "cap+multiplier", "embedding scale", "gelu"])
@pytest.mark.parametrize("graphs", ["eager", "static graphs"])
def test_gemma4_draft_logits_equal_the_reference_drafter(changes, graphs, targets, tmp_path):
    """Every draft lucebox makes in a continuous batch on the Gemma 4 target (taps captured by the
    engine's steps past the sliding window, a KV-shared layer tapped) has the logits the reference
    computes from transformers' Gemma 4 for the same tokens: the block embedded as the published
    drafters expect (sqrt(hidden)-scaled rows, or raw rows times the config's input_embedding_scale;
    no per-layer inputs), its LM head without the target's soft-cap, the drafter's own multiplier and
    cap."""
    pytest.importorskip("dflash.model")
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    from tests.spec.test_dflash_graphs import static_graphs
    target = targets("gemma4")
    path = write_reference_drafter(target, tmp_path / "drafter", **changes)
    reference = DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    target_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    config = {"method": "dflash", "model": str(path), "num_speculative_tokens": K, "adaptive": False}
    llm = LLM(str(target), block_size=BLOCK_SIZE, max_num_seqs=2, dtype="float32", speculative_config=config)
    prop = llm.engine.speculator.proposer
    assert prop.mask_token_id == GEMMA_MASK
    if graphs == "static graphs":
        prop.graphs = static_graphs(prop, llm.engine.runner.num_blocks, llm.engine.max_model_len)
    seen = []
    draft_logits = prop._draft_logits

    def recording(seq, k):
        logits = draft_logits(seq, k)
        seen.append((list(seq.prompt_token_ids) + list(seq.output_token_ids), k, logits.clone()))
        return logits
    prop._draft_logits = recording
    batch = prompts(llm.engine.loaded.config.vocab_size, [9, 14], seed=5)
    greedy(llm, batch, max_tokens=10)
    assert len(seen) >= 4 and max(len(tokens) for tokens, _, _ in seen) > 20
    tolerance = 1e-4 * changes.get("output_multiplier", 1.0)  # float32 rounding of the head, multiplied
    for tokens, k, got in seen:
        want = reference_draft_logits(target_model, reference, tokens, k)
        assert (got - want).abs().max().item() <= tolerance



def test_gguf_form_keeps_the_logit_and_input_settings(targets, tmp_path):
    """convert-drafter writes soft-cap, multiplier, input scale and activation; the GGUF drafter
    reads them back and computes the safetensors drafter's hidden states."""
    pytest.importorskip("dflash.model")
    from lucebox.spec.dflash import load_drafter
    from lucebox.spec.dflash_gguf import convert_drafter_to_gguf
    changes = {"final_logit_softcapping": 0.5, "output_multiplier": 40.0, "input_embedding_scale": 8.0,
               "hidden_act": "gelu_pytorch_tanh"}
    path = write_reference_drafter(targets("gemma4"), tmp_path / "d", torch.bfloat16, **changes)  # f16-exact
    st, _ = load_drafter(path, torch.float32, "cpu")
    gg, _ = load_drafter(convert_drafter_to_gguf(path, tmp_path / "d.gguf", "f16"), torch.float32, "cpu")
    for cfg in (st.config, gg.config):
        assert (cfg.final_logit_softcapping, cfg.output_multiplier, cfg.input_embedding_scale, cfg.activation) == \
            (0.5, 40.0, 8.0, "gelu_pytorch_tanh")
    g = torch.Generator().manual_seed(2)
    features = torch.randn(9, len(GEMMA_TAPS) * 64, generator=g)
    block = torch.randn(K + 1, 64, generator=g)
    with torch.no_grad():
        a, b = (d.blocks(block, torch.arange(9, 9 + K + 1), d.context_kv(features, torch.arange(9)), torch.arange(9))
                for d in (st, gg))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping must be a finite number"),
    ({"input_embedding_scale": 0}, "input_embedding_scale must be a positive finite number"),
    ({"output_multiplier": float("nan")}, "output_multiplier must be a positive finite number"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_bad_drafter_settings_are_named(targets, tmp_path, change, message):
    from lucebox.errors import CheckpointError
    from lucebox.spec.dflash2_model import read_config
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(gemma_drafter_config(targets("gemma4"), **change)))
    with pytest.raises(CheckpointError, match=message):
        read_config(out)

# ---------------------------------------------------------------------------------------------------
# Drafter training (`lucebox train-drafter`) on these targets

@pytest.mark.parametrize("family", ["gemma4", "laguna"])
def test_training_taps_are_transformers_hidden_states(family, targets):
    """The features a drafter trains on (train/prepare.TargetFeatures: the target's own paged forward,
    train/paged_target.py) equal transformers' hidden states after the tapped layers, rows past the
    sliding window and a KV-shared layer among the taps included; greedy tokens are its argmax."""
    from transformers import AutoModelForCausalLM

    from lucebox.model.loader import load_model
    from lucebox.train.prepare import TargetFeatures
    target = targets(family)
    loaded = load_model(str(target), dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    taps = [0, 2, 5] if family == "gemma4" else [0, 2]
    lengths = torch.tensor([13, 7, 10])
    ids = torch.randint(0, loaded.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(0))
    features, greedy_tokens = TargetFeatures(loaded.model, taps)(ids, lengths, greedy=True)
    for row, n in enumerate(lengths.tolist()):
        with torch.no_grad():
            out = reference(ids[row:row + 1, :n], output_hidden_states=True)
        want = torch.cat([out.hidden_states[t + 1][0] for t in taps], dim=-1)
        assert (features[row, :n] - want).abs().max().item() <= 1e-4
        assert greedy_tokens[row, :n].tolist() == out.logits[0].argmax(-1).tolist()


@pytest.mark.parametrize("family", ["gemma4", "gemma4-moe", "laguna"])
def test_one_training_step_writes_a_drafter_that_speculates_losslessly(family, targets, tmp_path, monkeypatch):
    """A Gemma 4 target's drafter carries its logit soft-cap (as z-lab's Gemma 4 drafter does) and
    trains on the block rows the engine drafts from: transformers' embedding module output (Gemma 4:
    scaled by sqrt(hidden)), as z-lab's training code embeds the block."""
    from transformers import AutoModelForCausalLM

    from lucebox.cli import main
    from lucebox.spec.dflash import load_drafter
    from lucebox.train import blocks
    from tests.conftest import TRAINING_TEXT
    target = targets(family)
    embeds, draft_hidden = [], blocks.draft_hidden

    def recording(drafter, embed, *args):
        embeds.append(embed)
        return draft_hidden(drafter, embed, *args)
    monkeypatch.setattr(blocks, "draft_hidden", recording)
    data = tmp_path / "data"
    data.mkdir()
    (data / "text.txt").write_text(TRAINING_TEXT * 4)
    out = tmp_path / "drafter"
    code = main(["train-drafter", "--target", str(target), "--data", str(data), "--out", str(out),
                 "--block-size", "4", "--seq-len", "32", "--layers", "1", "--taps", "0,2", "--batch-size", "4",
                 "--anchors", "8", "--steps", "1", "--eval-fraction", "0.2", "--eval-every", "0"])
    assert code == 0
    drafter, _ = load_drafter(out, torch.float32, "cpu")
    cap = json.loads((target / "config.json").read_text()).get("final_logit_softcapping")
    assert drafter.config.final_logit_softcapping == cap and (cap is not None) == family.startswith("gemma4")
    ids = torch.tensor([4, 17, 230])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).get_input_embeddings()(ids)
        assert embeds and all(torch.allclose(embed(ids).float(), want, atol=1e-6) for embed in embeds)
    plain = LLM(str(target), block_size=BLOCK_SIZE)
    batch = prompts(plain.engine.loaded.config.vocab_size, [9, 12], seed=2)
    want = [o.outputs[0].token_ids for o in greedy(plain, batch, 10)]
    spec = LLM(str(target), block_size=BLOCK_SIZE, speculative_config={
        "method": "dflash", "model": str(out), "num_speculative_tokens": K, "adaptive": False})
    outs = greedy(spec, batch, 10)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_training_forward_takes_the_drafter_activation_as_inference_does(targets):
    """train/blocks.draft_hidden with a drafter whose config sets Gemma's gelu_pytorch_tanh: each
    block equals the inference drafter's."""
    from lucebox.model.loader import load_model
    from lucebox.train import TrainDrafterArgs, blocks
    from lucebox.train.prepare import drafter_config, init_drafter
    loaded = load_model(str(targets("gemma4")), dtype="float32")
    args = TrainDrafterArgs(target="", data=["x"], out="", layers=2, block_size=4, taps="0,5")
    cfg = drafter_config(loaded.config, loaded.tokenizer, args)
    cfg.activation = "gelu_pytorch_tanh"
    drafter = init_drafter(cfg, "cpu", seed=3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.2 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 19, 2 * loaded.config.hidden_size, generator=g)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 19), generator=g)
    anchors = torch.tensor([[3, 11, 17]])
    with torch.no_grad():
        batched = blocks.draft_hidden(drafter, partial(drafter.block_input, loaded.model), features, ids, anchors,
                                      cfg.mask_token_id)
        for n, a in enumerate(anchors[0].tolist()):
            block = torch.tensor([int(ids[0, a])] + [cfg.mask_token_id] * (cfg.block_size - 1))
            one = drafter.blocks(drafter.block_input(loaded.model, block), torch.arange(a, a + cfg.block_size),
                                 drafter.context_kv(features[0, :a], torch.arange(a)), torch.arange(a))
            torch.testing.assert_close(batched[0, n], one, atol=2e-5, rtol=1e-4)
