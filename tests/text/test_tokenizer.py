"""Tokenizer: HF dirs and GGUF vocabularies encode like their originals; chat templates render like transformers."""

import json
import logging

import gguf
import pytest

from lucebox.errors import CheckpointError, UnsupportedError
from lucebox.text.tokenizer import Tokenizer
from tests.text.tokenizer_fixtures import (
    CORPUS,
    LLAMA3_TEMPLATE,
    MESSAGES,
    PARAGRAPHS,
    SPECIALS,
    TEXTS,
    added_token_json,
    gguf_from_hf,
    hand_spm_vocab,
    spm_reference_encode,
    train_byte_level_bpe,
    write_gguf,
    write_hf_dir,
)

# ---- HF directory loading ------------------------------------------------------------------------------


def test_hf_dir_reads_special_tokens_and_generation_config_eos_ids(tmp_path, chatml_bpe):
    d = write_hf_dir(tmp_path, chatml_bpe, bos_token="<|begin_of_text|>", eos_token=added_token_json("<|im_end|>"),
                     pad_token="<|endoftext|>", add_bos_token=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 0]}))
    tok = Tokenizer.from_hf_dir(d)
    ids = {t: chatml_bpe.token_to_id(t) for t in SPECIALS}
    assert tok.bos_token_id == ids["<|begin_of_text|>"]
    assert tok.eos_token_ids == {ids["<|im_end|>"], 6, 0}
    assert tok.pad_token_id == ids["<|endoftext|>"]
    assert tok.encode("hi")[0] == tok.bos_token_id and tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id
    assert set(ids.values()) <= set(tok.all_special_ids)
    assert tok.vocab_size == chatml_bpe.get_vocab_size(with_added_tokens=True)
    assert tok.id_to_token(ids["<|im_end|>"]) == "<|im_end|>" and tok.token_to_id("<|im_end|>") == ids["<|im_end|>"]


def test_missing_tokenizer_json_is_a_checkpoint_error_naming_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path / "tokenizer.json").replace("\\", "\\\\")):
        Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_corrupt_json_is_a_checkpoint_error_naming_the_file(tmp_path, chatml_bpe, name):
    d = write_hf_dir(tmp_path, chatml_bpe)
    (tmp_path / name).write_text("{ not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match=name):
        Tokenizer.from_hf_dir(d)


# ---- GGUF byte-level BPE --------------------------------------------------------------------------------


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_gguf_byte_level_bpe_encodes_like_the_hf_tokenizer_it_came_from(tmp_path, pre):
    hf = train_byte_level_bpe(pre)
    reader = gguf_from_hf(tmp_path / "t.gguf", hf, pre, add_eos_token_id=hf.token_to_id("<|im_end|>"),
                          add_add_bos_token=False)
    tok = Tokenizer.from_gguf(reader, tmp_path / "t.gguf")
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == expected, text
        assert tok.decode(expected, skip_special_tokens=False) == hf.decode(expected, skip_special_tokens=False)
        assert tok.decode(expected) == hf.decode(expected, skip_special_tokens=True)
    assert tok.eos_token_ids == {hf.token_to_id("<|im_end|>")}
    assert tok.decode(tok.encode("<|im_start|>hi<tool_call>")) == "hi<tool_call>"  # user-defined is not special


def test_gguf_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(tmp_path, caplog):
    hf = train_byte_level_bpe("gpt-2")
    with caplog.at_level(logging.WARNING, logger="lucebox.text.tokenizer"):
        tok = Tokenizer.from_gguf(gguf_from_hf(tmp_path / "t.gguf", hf, "some-future-model"))
    assert "some-future-model" in caplog.text
    assert tok.encode(TEXTS[0]) == hf.encode(TEXTS[0]).ids


def test_gguf_special_ids_and_chat_template_are_read(tmp_path):
    hf = train_byte_level_bpe("llama-bpe")
    ids = {t: hf.token_to_id(t) for t in SPECIALS}
    reader = gguf_from_hf(
        tmp_path / "t.gguf", hf, "llama-bpe", add_bos_token_id=ids["<|begin_of_text|>"],
        add_eos_token_id=ids["<|endoftext|>"], add_eot_token_id=ids["<|eot_id|>"],
        add_pad_token_id=ids["<|endoftext|>"], add_chat_template=LLAMA3_TEMPLATE,
    )
    tok = Tokenizer.from_gguf(reader)
    assert tok.bos_token_id == ids["<|begin_of_text|>"]
    assert tok.eos_token_ids == {ids["<|endoftext|>"], ids["<|eot_id|>"]}
    assert tok.pad_token_id == ids["<|endoftext|>"]
    assert tok.encode("hi")[0] == ids["<|begin_of_text|>"]  # llama-bpe adds BOS unless the file says otherwise
    prompt = tok.apply_chat_template(MESSAGES[:2])
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system")
    assert tok.encode(prompt, add_special_tokens=False)[:2] == [ids["<|begin_of_text|>"], ids["<|start_header_id|>"]]


def test_gguf_unknown_tokenizer_model_is_unsupported(tmp_path):
    reader = write_gguf(tmp_path / "t.gguf", "rwkv", ["a", "b"], [1, 1])
    with pytest.raises(UnsupportedError, match="rwkv"):
        Tokenizer.from_gguf(reader, tmp_path / "t.gguf")


def test_gguf_without_merges_is_a_checkpoint_error(tmp_path):
    reader = write_gguf(tmp_path / "t.gguf", "gpt2", ["a", "b"], [1, 1])
    with pytest.raises(CheckpointError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf(reader, tmp_path / "t.gguf")


# ---- GGUF SentencePiece ("llama") -----------------------------------------------------------------------


def test_gguf_spm_vocab_splits_known_pieces_and_round_trips(tmp_path):
    tokens, types, scores = hand_spm_vocab()
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", "llama", tokens, types, scores=scores))
    pieces = lambda ids: [tok.id_to_token(i) for i in ids]  # noqa: E731
    assert pieces(tok.encode("hello world")) == ["<s>", "\u2581hello", "\u2581world"]  # BOS by default for SPM
    assert pieces(tok.encode("hello world", add_special_tokens=False)) == ["\u2581hello", "\u2581world"]
    assert pieces(tok.encode("hell", add_special_tokens=False)) == ["\u2581hell"]
    # the best-scored pair is joined first, not the longest piece: ▁a (-12) then aa (-13), never ▁aa (-14)
    assert pieces(tok.encode("aaa", add_special_tokens=False)) == ["\u2581a", "aa"]
    # a special token in text is one token, and the text after it gets its own dummy-prefix space (llama.cpp)
    assert pieces(tok.encode("hello</s>world", add_special_tokens=False)) == ["\u2581hello", "</s>", "\u2581world"]
    # characters outside the vocabulary fall back to UTF-8 byte pieces
    assert pieces(tok.encode("w 世", add_special_tokens=False)) == ["\u2581w", "\u2581", "<0xE4>", "<0xB8>", "<0x96>"]
    for text in ["hello world", "  hello,  world!\n", "世界 hello 🦜", "abba dab", "helloworld"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        vocab = {t: i for i, t in enumerate(tokens)}
        assert ids[1:] == spm_reference_encode(text, vocab, scores), text


def test_gguf_spm_matches_sentencepiece_on_a_trained_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        character_coverage=1.0, split_digits=True, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, types, scores = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(
            gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
            else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.UNUSED if sp.is_unused(i)
            else gguf.TokenType.NORMAL
        )
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", "llama", tokens, types, scores=scores,
                                         add_bos_token_id=sp.bos_id(), add_eos_token_id=sp.eos_id()))
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == gguf.TokenType.NORMAL}
    vocab.update({f"<0x{b:02X}>": tokens.index(f"<0x{b:02X}>") for b in range(256)})
    for text in TEXTS[:4] + PARAGRAPHS:
        text = text.replace("<|", "< |")  # no control tokens here: sentencepiece would not match them in text
        expected = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == expected, text
        assert expected == spm_reference_encode(text, vocab, scores), text
        assert tok.decode(expected) == sp.decode(expected)
