"""`lucebox bench speed`: random models of named shapes, byte accounting, and the bench end to end on CPU."""
from __future__ import annotations

import json
import math

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from lucebox.bench import limits, shapes, speed, speed_report
from lucebox.cli import main
from lucebox.weights.quant import QuantEmbedding, QuantLinear

CPU = torch.device("cpu")
SMALL = dict(shape="tiny", device="cpu", prompt_lens=[32, 48], contexts=[32], decode_tokens=4, repeats=1)



@pytest.mark.parametrize("quant", sorted(shapes.QUANT_MIXES))
def test_random_quantised_weights_dequantise_to_finite_values_of_the_intended_scale(quant):
    loaded = shapes.build_random_model("tiny", quant, CPU)
    modules = [m for m in loaded.model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert len(modules) == 2 * 7 + 2  # seven matrices a layer, the embedding and the untied head
    for module in modules:
        values = module.weight.dequantize()
        assert torch.isfinite(values).all(), module.name
        assert 0.01 < values.std().item() < 0.04, (module.name, values.std().item())
        assert abs(values.mean().item()) < 0.01, module.name


def test_q4_k_m_gives_q6_k_to_attn_v_ffn_down_and_the_output_head_as_llama_cpp_does():
    model = shapes.build_random_model("tiny", "q4_k_m", CPU).model
    types = {name: m.qtype for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert types["layers.0.self_attn.v_proj"] == types["layers.1.mlp.down_proj"] == types["lm_head"] == Q.Q6_K
    assert types["layers.0.self_attn.q_proj"] == types["layers.1.mlp.up_proj"] == types["embed_tokens"] == Q.Q4_K


def test_named_shapes_are_the_real_qwen3_configs():
    cfg = shapes.shape_config("qwen3-8b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 36, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (12288, 151936, False)
    assert cfg.qk_norm and cfg.rope.theta == 1e6 and cfg.max_position_embeddings == 40960
    assert shapes.shape_config("qwen3-0.6b").tie_word_embeddings
    layers, head = limits.matmul_params(cfg)
    assert 7.5e9 < layers + head + cfg.vocab_size * cfg.hidden_size < 8.5e9  # "8B" parameters


def _matrix_bytes(qtype, rows: int, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return rows * cols // block * size


@pytest.mark.parametrize("quant,tied", [("bf16", False), ("q8_0", False), ("q4_k_m", False), ("q4_k_m", True)])
def test_bytes_per_token_are_every_weight_once_plus_one_embedding_row(quant, tied, monkeypatch):
    """Counted here from the shape alone, not from the model's tensors."""
    monkeypatch.setitem(shapes.SHAPES, "tiny", dict(shapes.SHAPES["tiny"], tie_word_embeddings=tied))
    loaded = shapes.build_random_model("tiny", quant, CPU)
    cfg, model = loaded.config, loaded.model
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    float_size = model.dtype.itemsize
    if quant == "bf16":
        def size(name, rows, cols):
            return rows * cols * 2
    else:
        main_type, special = shapes.QUANT_MIXES[quant]

        def size(name, rows, cols):
            return _matrix_bytes(special if name in ("v", "down", "head") else main_type, rows, cols)
    layer = (size("q", q, h) + size("k", kv, h) + size("v", kv, h) + size("o", h, q) + size("gate", inter, h)
             + size("up", inter, h) + size("down", h, inter) + float_size * (2 * h + 2 * cfg.head_dim))
    head = size("head", cfg.vocab_size, h)
    embed_row = size("head" if tied else "embed", 1, h)
    expected = cfg.num_layers * layer + float_size * h + head + embed_row
    assert limits.weight_bytes_per_token(model) == expected
    table = head if tied else size("embed", cfg.vocab_size, h)
    assert limits.weight_bytes(model) == expected - embed_row + (0 if tied else table)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_bench_speed_python_api_measures_every_phase_on_a_tiny_model():
    result = speed.run(speed.default_args(**SMALL, quant="f32", spec_method="ngram"))
    ref, model = result["reference"], result["model"]
    assert _positive(ref["gemv_gb_s"]) and _positive(ref["matmul_tflops"])
    assert [p["prompt_len"] for p in result["prefill"]] == [32, 48]
    for p in result["prefill"]:
        assert all(_positive(p[k]) for k in ("ttft_s", "tok_s", "tflops", "pct_matmul"))
        assert p["flops"] == limits.prefill_flops(shapes.shape_config("tiny"), p["prompt_len"])
    (d,) = result["decode"]
    assert all(_positive(d[k]) for k in ("tok_s", "ms_per_token", "gb_s", "pct_bandwidth"))
    assert model["kv_bytes_per_token"] == 2 * 2 * 64 * 2 * 4  # layers x kv heads x head_dim x (K, V) x float32
    assert d["bytes_per_token"] == model["weight_bytes_per_token"] + model["kv_bytes_per_token"] * (32 + 2.5)
    assert d["gb_s"] == pytest.approx(d["bytes_per_token"] * d["tok_s"] / 1e9)
    v = result["verify"]
    assert v["q_len"] == 16 and v["ratio"] == pytest.approx(v["verify_step_s"] / v["decode_step_s"])
    assert v["cuda_graph_replays"] is None and model["cuda_graph_replays"] is None  # no graphs on the CPU
    forced = result["forced"]  # float32 on both runs: every recorded token is accepted
    assert forced["acceptance"] == 1.0 and forced["tau"] > 1 and _positive(forced["speedup"])
    assert forced["rerecorded"] == 0 and forced["equal_to_plain_before"] == SMALL["decode_tokens"]
    assert forced["bound"] == pytest.approx(forced["tau"] * v["decode_step_s"] / v["verify_step_s"])
    assert result["spec"]["method"] == "ngram" and result["spec"]["tau"] >= 1 and _positive(result["spec"]["speedup"])
    peer = result["peer"]
    assert _positive(peer["tok_s"]) and peer["ratio"] == pytest.approx(peer["lucebox_tok_s"] / peer["tok_s"])
    # float32 on both sides over the very same tensors: transformers decodes the same greedy tokens
    assert peer["greedy_tokens_matching"] == 1 + SMALL["decode_tokens"]
    assert result["meta"]["torch"] == torch.__version__ and result["meta"]["date"]
    measures = [row[0] for row in speed_report.report_rows(result)]
    assert "GEMV bandwidth (reference)" in measures and any(m.startswith("transformers") for m in measures)


def test_bench_speed_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "speed.json"
    code = main(["bench", "speed", "--shape", "tiny", "--quant", "q8_0", "--device", "cpu", "--prompt-lens", "32",
                 "--contexts", "32", "--decode-tokens", "4", "--repeats", "1", "--skip", "verify", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| measure | value | limit / reference |" in table and "| decode at context 32 |" in table
    result = json.loads(out.read_text())
    assert result["model"]["quant"] == "q8_0" and result["model"]["quant_types"] == {"Q8_0": 16}
    assert result["meta"]["args"]["shape"] == "tiny" and result["meta"]["command"]
    assert _positive(result["decode"][0]["tok_s"]) and result["verify"] is None
    assert "skipped" in result["peer"] and "q8_0" in result["peer"]["skipped"]


@pytest.mark.parametrize("argv,named", [
    (["--shape", "qwen9-1b"], "qwen9-1b"),
    (["--shape", "tiny", "--quant", "q3_k"], "q3_k"),
    (["--shape", "tiny", "--contexts", "5000"], "--contexts 5000"),
    (["--shape", "tiny", "--prompt-lens", "0"], "--prompt-lens 0"),
    (["--shape", "tiny", "--model", "x"], "--shape"),
])
def test_bench_speed_rejects_bad_flags_naming_what_is_wrong(argv, named, capsys):
    assert main(["bench", "speed", "--device", "cpu", "--skip", "reference", *argv]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and named in err and "Traceback" not in err


def test_bare_bench_runs_speed_with_its_defaults(monkeypatch):
    seen = {}
    monkeypatch.setattr(speed, "main", lambda args: seen.setdefault("args", args) and 0)
    assert main(["bench"]) == 0
    args = seen["args"]
    assert args.bench == "speed" and args.contexts is None and args.decode_tokens == 128 and args.shape is None


def test_default_lengths_that_do_not_fit_the_model_are_skipped_with_a_note():
    result = speed.run(speed.default_args(shape="tiny", device="cpu", decode_tokens=2, repeats=1,
                                          skip=["reference", "prefill", "verify", "peer", "spec"]))
    assert [d["context"] for d in result["decode"]] == [512]  # tiny has 4,096 positions
    assert any("4096" in note and "32768" in note for note in result["notes"])


def test_bench_spec_compares_each_proposer_with_plain_decoding_in_one_run(hf_models, tmp_path):
    """`lucebox bench spec` end to end on a tiny model: every configuration decodes every prompt in
    every round (interleaved prompt by prompt), and the figures add up."""
    out = tmp_path / "spec.json"
    target = str(hf_models["qwen3"])
    assert main(["bench", "spec", "--model", target, "--draft", target, "--spec-method", "draft_model",
                 "--prompts", "2", "--chars", "200", "--max-tokens", "6", "--repeats", "2", "--no-adaptive",
                 "--temperatures", "0", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["temperature"]) for r in rows] == [
        (m, t) for t in (0.0, 1.0) for m in ("plain", "plain again", "draft_model", "draft_model+ngram", "ngram")]
    for r in rows:
        assert r["tokens"] == 2 * 5 and r["seconds"] > 0 and r["speedup"] > 0
        low, high = r["speedup_range"]  # paired by repeat: plain against itself is exactly 1
        assert low <= r["speedup"] <= high and (r["method"] != "plain" or low == high == 1.0)
        assert r["accepted_tokens"] <= r["draft_tokens"]
        assert r["steps"]["prefill"] == 2 * 2 and "overlapped" not in r["steps"]  # no CUDA graphs on the CPU
    plain = rows[0]["steps"]
    assert plain == {"prefill": 4, "plain": 2 * 2 * 5}  # 5 decode steps a request after its prefill
    assert rows[1]["steps"] == plain and rows[1]["draft_tokens"] == 0  # the control: plain decoding again
    for r in rows:
        control = next(c for c in rows if c["method"] == "plain again" and c["temperature"] == r["temperature"])
        assert r["vs_control"] == pytest.approx(r["speedup"] / control["speedup"])
        low, high = r["per_request_interval"]  # every request against the control's on its prompt, its pass
        assert low <= r["per_request_vs_control"] <= high
        assert r["method"] != "plain again" or low == high == r["per_request_vs_control"] == 1.0
    # The target drafting for itself at temperature 0 (every step drafts: --no-adaptive; adaptive
    # speculation would rightly keep a drafter as slow as the target off): every draft is accepted.
    self_draft = next(r for r in rows if r["method"] == "draft_model" and r["temperature"] == 0)
    assert self_draft["draft_tokens"] > 0 and self_draft["accepted_tokens"] == self_draft["draft_tokens"]
    assert self_draft["steps"]["verify"] > 0


def test_forced_acceptance_re_records_drafts_the_verifier_would_not_accept(monkeypatch):
    """Where a verify's argmax differs from the plain recording's (bf16 near-ties on a GPU; here the
    recording is corrupted at token 5), the drafts are re-recorded from the speculating engine's own
    output: then every draft is accepted, and the result says it was re-recorded and where."""
    from lucebox.bench import forced as forced_module
    record = forced_module.greedy_output
    calls = []

    def corrupted_first(engine, prompt, params):
        output = record(engine, prompt, params)
        calls.append(engine.speculator is not None)
        if len(calls) == 1:
            output[5] = (output[5] + 1) % engine.model.config.vocab_size
        return output
    monkeypatch.setattr(forced_module, "greedy_output", corrupted_first)
    args = speed.default_args(**dict(SMALL, decode_tokens=12), quant="f32", skip=["prefill", "peer", "spec"])
    result = speed.run(args)
    forced = result["forced"]
    assert calls == [False, True, True]  # the plain recording, then the speculating engine twice
    assert forced["rerecorded"] == 1 and forced["equal_to_plain_before"] == 5 and forced["acceptance"] == 1.0
    assert forced["reproduced"] == [5] and forced["converged"]


def test_forced_acceptance_says_when_re_recording_did_not_converge(monkeypatch):
    """A speculating engine that never reproduces its drafts (every run's token 3 changed) stops
    after MAX_RERECORDINGS re-recordings and says it did not converge."""
    from lucebox.bench import forced as forced_module
    record, runs = forced_module.greedy_output, []

    def never_the_same(engine, prompt, params):
        output = record(engine, prompt, params)
        runs.append(engine.speculator is not None)
        output[3] = (output[3] + len(runs)) % engine.model.config.vocab_size
        return output
    monkeypatch.setattr(forced_module, "greedy_output", never_the_same)
    monkeypatch.setattr(forced_module, "MAX_RERECORDINGS", 2)
    args = speed.default_args(**dict(SMALL, decode_tokens=8), quant="f32", skip=["prefill", "peer", "spec"])
    result = speed.run(args)
    forced = result["forced"]
    assert runs == [False, True, True, True]
    assert forced["rerecorded"] == 2 and forced["reproduced"] == [3, 3] and not forced["converged"]
    assert any("re-recorded 2x NOT CONVERGED" in row[0] for row in speed_report.report_rows(result))


def test_the_per_request_median_comes_with_an_interval_that_narrows_with_more_requests():
    """bench spec's per-request figure: the median of paired ratios and its bootstrap 95% interval,
    which covers the true median and narrows as requests are added (seeded: deterministic)."""
    import random

    from lucebox.bench.spec import median_interval
    rng = random.Random(1)
    few, many = ([rng.gauss(1.0, 0.1) for _ in range(n)] for n in (12, 480))
    median, low, high = median_interval(many)
    assert low <= median <= high and low < 1.0 < high and high - low < 0.04
    _, low_few, high_few = median_interval(few)
    assert high_few - low_few > 2 * (high - low)
    assert median_interval([1.0] * 5) == (1.0, 1.0, 1.0)


def test_the_transformers_peer_leaves_later_transformers_models_initialised():
    """Building the peer must not leave transformers holding lucebox's no-op initialisers (it captures
    torch's init functions when it first imports a modeling module): a later transformers model would
    keep nn.Linear's default init instead of its own normal(0, initializer_range). A fresh process, so
    that the peer is the first to import the modeling module."""
    script = """
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from lucebox.bench import shapes, transformers_peer
loaded = shapes.build_random_model("tiny", "f32", torch.device("cpu"))
transformers_peer.transformers_twin(loaded, AutoConfig.for_model(**shapes.SHAPES["tiny"]), torch.device("cpu"))
config = AutoConfig.for_model(**shapes.SHAPES["tiny"])
model = AutoModelForCausalLM.from_config(config)
print(model.model.layers[0].mlp.up_proj.weight.std().item() / config.initializer_range)
"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 0.8 < float(out.stdout.strip().splitlines()[-1]) < 1.2
