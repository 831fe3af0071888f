"""Extending the default model's context with YaRN: lucebox's YaRN RoPE is transformers' beyond the
original context, scripts/extend_default_context.py writes a loadable 64K-position model, and the
DFlash drafter carries the target's YaRN RoPE (config round trip, --init-drafter)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lucebox.cli import main
from lucebox.engine.block_manager import BlockManager
from lucebox.engine.runner import ModelRunner
from lucebox.model.config import ModelConfig, with_yarn
from lucebox.model.loader import load_model
from lucebox.model.rope import RopeTable
from lucebox.spec.dflash2_model import read_config
from lucebox.spec.dflash_model import DFlashDrafter, save_drafter
from lucebox.train import TrainDrafterArgs
from lucebox.train.lm import dense_forward
from lucebox.train.prepare import drafter_config, init_drafter

from tests.conftest import build_hf_model

ROOT = Path(__file__).resolve().parents[2]
SEQ = 300  # positions well past the fixture's original context of 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def extend(src: Path, dst: Path, context: int) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(with_yarn(raw, context)))
    return dst


@pytest.fixture(scope="module")
def yarn_qwen3(tmp_path_factory, tokenizer_dir) -> Path:
    """A random Qwen3 of context 64 (transformers-saved, rope_parameters), YaRN-extended to 512."""
    base = build_hf_model("qwen3", tmp_path_factory.mktemp("qwen3-64"), tokenizer_dir, max_position_embeddings=64)
    return extend(base, tmp_path_factory.mktemp("yarn") / "model", 512)


def test_with_yarn_writes_the_legacy_rope_scaling_of_the_brief(yarn_qwen3):
    raw = json.loads((yarn_qwen3 / "config.json").read_text())
    assert raw["max_position_embeddings"] == 512 and "rope_parameters" not in raw
    assert raw["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
    assert raw["rope_theta"] == 1e6


def test_yarn_logits_match_transformers_beyond_the_original_context(yarn_qwen3):
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(yarn_qwen3, dtype=torch.float32)
    assert reference.config.rope_parameters["rope_type"] == "yarn"
    prompt = torch.randint(0, reference.config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(prompt[None]).logits[0]
    loaded = load_model(str(yarn_qwen3), dtype="float32")
    assert loaded.config.rope.type == "yarn" and loaded.config.max_position_embeddings == 512
    with torch.no_grad():  # the training forward
        dense = loaded.model.compute_logits(dense_forward(loaded.model, prompt[None]))[0]
    runner, blocks = ModelRunner(loaded.model, 128, 4), BlockManager(128, 4)
    table: list[int] = []
    blocks.allocate(table, SEQ)
    paged = runner.forward([prompt.tolist()], [0], [table], all_logits=True).cpu()  # the serving forward
    for got in (dense, paged):
        assert (got - expected).abs().max().item() <= 1e-4
    # Not vacuous: the same weights with plain RoPE disagree past the original context.
    plain = load_model(str(yarn_qwen3), dtype="float32")
    plain.model.rope = RopeTable(ModelConfig.from_hf_dict({**json.loads((yarn_qwen3 / "config.json").read_text()),
                                                           "rope_scaling": None}).rope, plain.config.head_dim)
    with torch.no_grad():
        off = plain.model.compute_logits(dense_forward(plain.model, prompt[None]))[0]
    assert (off[64:] - expected[64:]).abs().max().item() > 1e-2


def test_drafter_config_carries_the_targets_yarn_rope_through_save_and_load(yarn_qwen3, tmp_path):
    loaded = load_model(str(yarn_qwen3), dtype="float32")
    args = TrainDrafterArgs(target=str(yarn_qwen3), data=["x"], out="", layers=1, block_size=4, taps="0,1")
    cfg = drafter_config(loaded.config, loaded.tokenizer, args)
    assert cfg.model.rope == loaded.config.rope and cfg.model.max_position_embeddings == 512
    save_drafter(init_drafter(cfg, "cpu", 0), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
    back = read_config(tmp_path)
    assert back.model.rope == loaded.config.rope
    table, target_table = DFlashDrafter(back).rope, loaded.model.rope
    assert torch.equal(table.inv_freq, target_table.inv_freq) and table.scaling == target_table.scaling


def test_init_drafter_starts_from_a_trained_drafter_with_the_targets_yarn(yarn_qwen3, tokenizer_dir, tmp_path):
    """A drafter of the plain target, extended: the new run starts from its weights (a learning rate
    of ~0 leaves them) and writes the YaRN target's RoPE and context."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n" * 40)
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--data", str(corpus), "--block-size", "4", "--seq-len", "40", "--prompt-len", "16", "--regenerate",
              "--batch-size", "4", "--anchors", "8", "--eval-fraction", "0", "--save-dtype", "float32", "--layers", "1"]
    plain = build_hf_model("qwen3", tmp_path / "plain", tokenizer_dir, max_position_embeddings=64)
    assert main(["train-drafter", "--target", str(plain), "--out", str(first), "--steps", "3", *common]) == 0
    assert json.loads((first / "config.json").read_text())["rope_scaling"] is None
    assert main(["train-drafter", "--target", str(yarn_qwen3), "--out", str(second), "--steps", "1",
                 "--init-drafter", str(first), "--lr", "1e-12", "--regen-tokens", "8", *common]) == 0
    raw = json.loads((second / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "yarn" and raw["max_position_embeddings"] == 512
    before, after = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)
    regenerated = torch.load(second / "regenerated.pt", weights_only=True)["train"]
    assert regenerated and all(int(mask.sum()) <= 8 for _, mask in regenerated)


def test_extension_script_writes_a_loadable_64k_yarn_model(tmp_path, tokenizer_dir):
    base = build_hf_model("qwen3", tmp_path / "base", tokenizer_dir, max_position_embeddings=2048)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "bisect.py", "colorsys.py", "keyword.py"):
        shutil.copy(stdlib / name, corpus / name)
    # Small documented functions: chat tasks that fit in the chat stage's 512 tokens.
    (corpus / "small.py").write_text("".join(f'def add_{i}(a, b):\n    """Add {i}."""\n    c = a + {i}\n    return c + b\n\n\n'
                                             for i in range(30)))
    out = tmp_path / "extended"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "extend_default_context.py"), "--base", str(base),
                          "--out", str(out), "--corpus-dir", str(corpus), "--steps", "2", "--long-lens", "256",
                          "--tokens-per-step", "512", "--eval-windows", "1", "--seconds", "60", "--lr", "0.05"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    raw = json.loads((out / "config.json").read_text())
    assert raw["max_position_embeddings"] == 65536
    assert raw["rope_scaling"] == {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048}
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json", "stats.json"):
        assert (out / name).is_file(), name
    stats = json.loads((out / "stats.json").read_text())["long_context"]
    assert stats["train"]["steps"] == 2
    assert set(stats["loss_by_position"]) == {"base", "yarn_untrained", "extended"}
    loaded = load_model(str(out), dtype="float32")
    assert loaded.config.rope.type == "yarn" and loaded.config.max_position_embeddings == 65536
    trained = loaded.model.layers[0].self_attn.q_proj.weight
    original = load_model(str(base), dtype="float32").model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(trained, original.to(torch.bfloat16).float())  # saved in bf16, after training
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert reference.config.rope_parameters["factor"] == 32.0
