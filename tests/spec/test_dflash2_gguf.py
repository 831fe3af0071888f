"""`lucebox convert-drafter` on a DFlash2 drafter: the GGUF reads back equal (every tensor, the
DFlash2 settings), and the quantised file drafts losslessly in the engine."""
from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file, save_file

from lucebox import LLM, SamplingParams
from lucebox.cli import main
from lucebox.spec.dflash import load_drafter
from lucebox.spec.dflash2 import DFlash2Proposer
from lucebox.spec.dflash2_model import DFlash2Drafter
from tests.spec.test_dflash2 import write_dflash2_drafter


@pytest.fixture(scope="module")
def drafter_dir(hf_models, tmp_path_factory):
    """A synthetic DFlash2 checkpoint whose values are float16 values, so an F16 file holds them exactly."""
    out = write_dflash2_drafter(hf_models["qwen3"], tmp_path_factory.mktemp("dflash2"), block_size=4, top_k=6)
    tensors = {k: v.half().float() for k, v in load_file(str(out / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_f16_file_reads_back_equal(drafter_dir, tmp_path):
    out = tmp_path / "d.gguf"
    assert main(["convert-drafter", str(drafter_dir), str(out), "--outtype", "f16"]) == 0
    reader = GGUFReader(out)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "dflash-draft"
    assert int(reader.fields["dflash-draft.dflash.selector_top_k"].parts[-1][0]) == 6
    names = {t.name for t in reader.tensors}
    # llama.cpp's DFlash2 names
    assert {"blk.0.attn_conv_base", "blk.1.ffn_conv_proj.weight", "selector_predecessor.weight",
            "selector_successor.weight", "selector_hidden.weight"} <= names
    ours, _ = load_drafter(drafter_dir, torch.float32, "cpu")
    back, _ = load_drafter(out, torch.float32, "cpu")
    assert isinstance(back, DFlash2Drafter)
    assert back.config.to_dict() == ours.config.to_dict()
    want, got = ours.state_dict(), back.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_q8_0_file_drafts_losslessly_in_the_engine(hf_models, drafter_dir, tmp_path):
    target = hf_models["qwen3"]
    out = tmp_path / "d.gguf"
    assert main(["convert-drafter", str(drafter_dir), str(out), "--outtype", "q8_0"]) == 0
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 9, 33, 7, 5, 9, 33, 7]}]
    plain = LLM(str(target), block_size=4).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(target), block_size=4, speculative_config={"method": "dflash", "model": str(out), "adaptive": False})
    assert isinstance(llm.engine.speculator.proposer, DFlash2Proposer)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == plain
