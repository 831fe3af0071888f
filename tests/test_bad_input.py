"""Checkpoints and flags are untrusted input: each problem is one clear LuceboxError."""
from __future__ import annotations

import json
import shutil

import pytest

from lucebox.errors import CheckpointError, RequestError, UnsupportedError
from lucebox.model.loader import load_model


@pytest.fixture
def model_copy(hf_models, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(hf_models["qwen3"], dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"))


def test_missing_config_names_the_file(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(str(model_copy))


def test_corrupt_config_json_names_the_file(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json.*not valid JSON"):
        load_model(str(model_copy))


def test_unknown_architecture_is_unsupported(model_copy):
    edit_config(model_copy, model_type="gpt_neox")
    with pytest.raises(UnsupportedError, match="gpt_neox"):
        load_model(str(model_copy))


def test_unknown_rope_scaling_is_unsupported(model_copy):
    edit_config(model_copy, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(UnsupportedError, match="longrope"):
        load_model(str(model_copy))


def test_missing_weights_are_reported(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(str(model_copy))


def test_truncated_safetensors_names_the_file(model_copy):
    file = model_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(str(model_copy))


def test_tensor_shape_that_does_not_fit_the_config_names_the_tensor(model_copy):
    edit_config(model_copy, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.\w+_proj\.weight has shape"):
        load_model(str(model_copy))


def test_missing_tensor_is_named(model_copy):
    edit_config(model_copy, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    with pytest.raises(CheckpointError, match="num_hidden_layers is 3, but the weights hold layers 0 to 1"):
        load_model(str(model_copy))


def test_missing_shard_named_in_the_index(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_model(str(model_copy))


def test_sharded_checkpoint_loads_like_a_single_file(hf_models, tmp_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"])
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_models["llama"] / name, tmp_path / name)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, single = load_model(str(tmp_path)).model, load_model(str(hf_models["llama"])).model
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert a.equal(b), name


def test_bad_dtype_and_device_flags_name_the_flag(hf_models):
    with pytest.raises(RequestError, match="--dtype"):
        load_model(str(hf_models["qwen3"]), dtype="int3")
    with pytest.raises(RequestError, match="--device"):
        load_model(str(hf_models["qwen3"]), device="tpu")
