"""lucebox convert-drafter: a DFlash drafter as GGUF (F16, Q8_0) loads back and drafts what the
safetensors drafter drafts; Q8_0 stays quantised and runs in the engine; bad input is a clear error."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from lucebox import LLM, SamplingParams
from lucebox.cli import main
from lucebox.convert import convert_hf_to_gguf
from lucebox.errors import CheckpointError
from lucebox.model.config import ModelConfig
from lucebox.spec.dflash import load_drafter
from lucebox.spec.dflash_gguf import convert_drafter_to_gguf
from lucebox.spec.dflash_model import DFlashConfig, DFlashDrafter, save_drafter
from lucebox.weights.quant import QuantLinear

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push", "import os, sys"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread is as fast as two, and immune to thread contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def drafter_dir(hf_models, tmp_path_factory):
    """A random 2-layer drafter for the qwen3 fixture, its weights already float16 values, so an F16
    file holds them exactly."""
    target = ModelConfig.from_hf_dir(hf_models["qwen3"])
    model = ModelConfig(family="qwen3", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                        intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                        max_position_embeddings=target.max_position_embeddings, qk_norm=True)
    cfg = DFlashConfig(model, [0, 1], target.vocab_size - 1, 6, target.num_layers)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_((torch.rand_like(p) + 0.5) if "norm" in name else torch.randn_like(p) * 0.15)
            p.copy_(p.half().float())
    out = tmp_path_factory.mktemp("dflash")
    save_drafter(drafter, out)
    return out


def drafts(drafter, target_embed, features, anchor_token: int):
    """The drafted block (argmax per slot) and the hidden states, for a fixed context."""
    n = features.shape[0]
    cfg = drafter.config
    context = drafter.context_kv(features, torch.arange(n))
    block = torch.tensor([anchor_token] + [cfg.mask_token_id] * (cfg.block_size - 1))
    hidden = drafter.blocks(target_embed(block), torch.arange(n, n + cfg.block_size), context, torch.arange(n))
    return hidden


@pytest.fixture(scope="module")
def target(hf_models):
    from lucebox.model.loader import load_model
    return load_model(str(hf_models["qwen3"]))


def test_f16_gguf_drafts_what_the_safetensors_drafter_drafts(drafter_dir, target, tmp_path):
    path = convert_drafter_to_gguf(drafter_dir, tmp_path / "d.gguf", "f16")
    st, _ = load_drafter(drafter_dir, torch.float32, "cpu")
    gg, where = load_drafter(path, torch.float32, "cpu")
    assert where == path and gg.config.target_layer_ids == [0, 1] and gg.config.block_size == 6
    features = torch.randn(11, 2 * target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = drafts(st, target.model.embed_tokens, features, 42)
        b = drafts(gg, target.model.embed_tokens, features, 42)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    logits_a, logits_b = target.model.compute_logits(a[1:]), target.model.compute_logits(b[1:])
    assert torch.equal(logits_a.argmax(-1), logits_b.argmax(-1))


def test_gguf_layout_names_metadata_and_types(drafter_dir, tmp_path):
    reader = GGUFReader(convert_drafter_to_gguf(drafter_dir, tmp_path / "d.gguf", "q8_0"))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "dflash-draft"
    assert fields["dflash-draft.dflash.target_layer_ids"] == [0, 1]
    assert fields["dflash-draft.dflash.block_size"] == 6 and fields["dflash-draft.block_count"] == 2
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["dflash_fc.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.1.attn_q.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_k_norm.weight"] == GGMLQuantizationType.F32
    assert types["output_norm.weight"] == GGMLQuantizationType.F32
    assert not any(n.startswith(("token_embd", "output.weight")) for n in types)
    assert not list(tmp_path.glob("*.partial"))  # written beside the destination, then renamed


def test_q8_0_gguf_stays_quantised_and_is_lossless_in_the_engine(drafter_dir, hf_models, target, tmp_path):
    path = tmp_path / "d-q8_0.gguf"
    assert main(["convert-drafter", str(drafter_dir), str(path), "--outtype", "q8_0"]) == 0
    q8, _ = load_drafter(path, torch.float32, "cpu")
    assert isinstance(q8.layers[0].self_attn.q_proj, QuantLinear)
    assert isinstance(q8.layers[1].mlp.down_proj, QuantLinear)
    st, _ = load_drafter(drafter_dir, torch.float32, "cpu")
    features = torch.randn(9, 2 * target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = drafts(st, target.model.embed_tokens, features, 7)
        b = drafts(q8, target.model.embed_tokens, features, 7)
    assert (a - b).norm() / a.norm() < 0.05  # 8-bit weights: close, not equal

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(hf_models["qwen3"]), block_size=4).generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(str(hf_models["qwen3"]), block_size=4,
               speculative_config={"method": "dflash", "model": str(path), "adaptive": False})
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [p.outputs[0].token_ids for p in plain]
    assert all(o.metrics.num_drafts > 0 for o in outs)


def test_f16_gguf_and_safetensors_drafters_accept_the_same_drafts_in_the_engine(drafter_dir, hf_models, tmp_path):
    path = convert_drafter_to_gguf(drafter_dir, tmp_path / "d.gguf", "f16")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for model in (drafter_dir, path):
        llm = LLM(str(hf_models["qwen3"]), block_size=4,
                  speculative_config={"method": "dflash", "model": str(model), "adaptive": False})
        runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.metrics.accepted_per_position == b.metrics.accepted_per_position


def test_bad_input_is_a_clear_error(drafter_dir, hf_models, tmp_path, capsys):
    assert main(["convert-drafter", str(drafter_dir), str(tmp_path / "d.gguf"), "--outtype", "q4_0"]) == 1
    assert "--outtype 'q4_0'" in capsys.readouterr().err
    assert main(["convert-drafter", str(tmp_path / "missing"), str(tmp_path / "d.gguf")]) == 1
    assert "not a DFlash drafter directory" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    target_gguf = convert_hf_to_gguf(hf_models["qwen3"], tmp_path / "target.gguf", "f16")
    with pytest.raises(CheckpointError, match="not a DFlash drafter"):
        load_drafter(target_gguf, torch.float32, "cpu")


def test_yarn_attention_factor_follows_llama_cpp_and_reads_back(drafter_dir, tmp_path):
    """llama.cpp multiplies rope.scaling.attn_factor by its own YaRN scale (0.1 ln(factor) + 1), so the
    file holds HF's attention_factor divided by it, as `lucebox convert` writes targets."""
    import json
    import math
    import shutil

    from lucebox.model.gguf_config import Metadata
    from lucebox.spec.dflash_gguf import read_gguf_config
    yarn_dir = tmp_path / "yarn"
    shutil.copytree(drafter_dir, yarn_dir)
    raw = json.loads((yarn_dir / "config.json").read_text())
    raw["rope_scaling"] = raw["rope_parameters"] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 1024,
                                                    "attention_factor": 1.3}
    (yarn_dir / "config.json").write_text(json.dumps(raw))
    path = convert_drafter_to_gguf(yarn_dir, tmp_path / "y.gguf", "f16")
    reader = GGUFReader(path)
    stored = reader.fields["dflash-draft.rope.scaling.attn_factor"].contents()
    assert stored == pytest.approx(1.3 / (0.1 * math.log(8.0) + 1.0), rel=1e-6)
    rope = read_gguf_config(Metadata(reader, path)).model.rope
    assert rope.type == "yarn" and rope.attention_factor == pytest.approx(1.3, rel=1e-6)
    assert rope.factor == 8.0
