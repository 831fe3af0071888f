"""The command line: streams, reports speed, keeps a chat, prints errors without tracebacks."""
from __future__ import annotations

import pytest

from lucebox.cli import main


def test_cli_prints_errors_without_traceback_and_exits_nonzero(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err


def test_cli_rejects_invalid_sampling_value(hf_models, capsys):
    code = main(["generate", "--model", str(hf_models["qwen3"]), "--top-p", "2"])
    assert code == 1 and "top_p" in capsys.readouterr().err


def test_cli_generate_streams_text_and_reports_speed(hf_models, capsys):
    code = main(["generate", "--model", str(hf_models["qwen3"]), "--prompt", "def", "--max-tokens", "4",
                 "--temperature", "0", "--ignore-eos"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("def") and "tok/s" in captured.err


def test_cli_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--dtype", "--max-model-len", "--temperature", "--max-tokens", "--stop"):
        assert flag in text
    assert "(default: 128)" in text


def test_cli_chat_keeps_the_conversation(hf_models, monkeypatch, capsys):
    lines = iter(["hello", "and again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    rendered = []
    from lucebox.text.tokenizer import Tokenizer
    original = Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        rendered.append([m["content"] for m in messages])
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", spy)
    code = main(["chat", "--model", str(hf_models["qwen3"]), "--max-tokens", "3", "--temperature", "0",
                 "--ignore-eos"])
    assert code == 0
    assert rendered[0] == ["hello"]
    assert rendered[1][0] == "hello" and rendered[1][2] == "and again" and len(rendered[1]) == 3


def test_cli_generate_with_speculation_prints_the_same_greedy_text(hf_models, capsys):
    args = ["generate", "--model", str(hf_models["qwen3"]), "--prompt", "def", "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--draft", str(hf_models["qwen3"]), "--spec-method", "draft_model"]) == 0
    assert capsys.readouterr().out == plain
    assert main(args + ["--draft", str(hf_models["qwen3"]), "--spec-method", "draft_model", "--spec-ngram-first"]) == 0
    assert capsys.readouterr().out == plain


def _engine_args(*flags):
    from lucebox.cli import build_parser, engine_args
    return engine_args(build_parser().parse_args(["generate", *flags]))


def test_speculation_flags_build_a_typed_speculative_config():
    from lucebox.config import SpeculativeConfig
    got = _engine_args("--draft", "d", "--spec-tokens", "3", "--spec-ngram-first", "--no-spec-adaptive")
    assert got.speculative_config == SpeculativeConfig(method="dflash", model="d", num_speculative_tokens=3,
                                                       adaptive=False, ngram_first=True)
    assert _engine_args("--spec-method", "ngram").speculative_config == SpeculativeConfig(method="ngram")


def test_no_speculation_flag_leaves_the_default_and_no_spec_turns_it_off():
    assert _engine_args().speculative_config is None  # the default model's own, resolved by from_args
    assert not _engine_args("--no-spec").speculative_config.enabled
    assert _engine_args("--no-spec", "--spec-method", "ngram").speculative_config.method == "ngram"


def test_prefill_graphs_are_on_unless_turned_off():
    assert _engine_args().prefill_graphs and not _engine_args("--no-prefill-graphs").prefill_graphs


def test_a_bad_speculation_flag_is_an_error_without_traceback(hf_models, capsys):
    code = main(["generate", "--model", str(hf_models["qwen3"]), "--spec-method", "dflash"])
    err = capsys.readouterr().err
    assert code == 1 and "needs a draft model" in err and "Traceback" not in err


def test_cli_says_what_it_built_before_generating(hf_models, capsys):
    assert main(["generate", "--model", str(hf_models["qwen3"]), "--max-model-len", "96", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"[{hf_models['qwen3']}: KV cache holds" in err and "context 96]" in err
