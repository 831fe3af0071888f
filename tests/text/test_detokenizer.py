"""The incremental detokenizer: whole characters out of byte tokens, byte-fallback pieces, special tokens,
several ids at once, the first token's leading space, and a window that stays short."""

import pytest

from lucebox.text.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.text.tokenizer_fixtures import hand_spm_vocab, train_byte_level_bpe, write_gguf

def stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.push(i) for i in ids]
    return pieces + [detok.flush()]


def test_incremental_detokenizer_emits_whole_characters_split_across_byte_tokens():
    hf = train_byte_level_bpe("qwen2")
    tok = Tokenizer.from_tokenizers(hf)
    text = "A parrot 🦜 says 鸚鵡 and 👩‍💻 codes, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢!"
    ids = tok.encode(text)
    assert len(ids) > len(text.split()) * 2  # the unseen characters really are split into byte tokens
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any("🦜" in p for p in pieces) and any("鸚" in p for p in pieces)


def test_incremental_detokenizer_with_byte_fallback_pieces(tmp_path):
    tokens, types, scores = hand_spm_vocab()
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", "llama", tokens, types, scores=scores))
    ids = tok.encode("hello 世界 world 🦜!")
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == "hello 世界 world 🦜!"
    assert not any("\ufffd" in p for p in pieces)
    assert "世" in pieces and "界" in pieces and "🦜" in pieces


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_skip_special_tokens(skip):
    hf = train_byte_level_bpe("qwen2")
    tok = Tokenizer.from_tokenizers(hf)
    ids = tok.encode("<|im_start|>assistant\n東京 🦜<|im_end|><|endoftext|>")
    pieces = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


def test_incremental_detokenizer_several_ids_at_once_and_flush_of_an_incomplete_character():
    tok = Tokenizer.from_tokenizers(train_byte_level_bpe("gpt-2"))
    ids = tok.encode("ok 🦜")
    assert IncrementalDetokenizer(tok).push(ids) == "ok 🦜"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == ""  # the parrot's last byte is missing, so nothing is final yet
    assert detok.flush() == tok.decode(ids[:-1])  # at the end of a stream, what is left comes out as is
    assert detok.flush() == ""


def test_incremental_detokenizer_context_ids_keep_the_first_tokens_leading_space(tmp_path):
    tokens, types, scores = hand_spm_vocab()
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", "llama", tokens, types, scores=scores))
    prompt, output = tok.encode("hello"), tok.encode("world", add_special_tokens=False)
    assert stream(tok, output) == ["world", ""]  # on its own, SentencePiece drops the dummy-prefix space
    assert stream(tok, output, context_ids=prompt) == [" world", ""]  # after "hello" it is a real space


def test_a_run_that_never_completes_a_character_keeps_the_window_short(tmp_path):
    """200 lone continuation bytes: no character ever completes. The detokenizer emits them as
    replacement characters once the run is longer than any character could be, so each step decodes
    a bounded window (not everything since the last character), and the text still adds up."""
    tokens, types, scores = hand_spm_vocab()
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", "llama", tokens, types, scores=scores))
    ids = [tokens.index("<0x80>")] * 200
    windows = []
    decode = tok.decode
    tok.decode = lambda window, **kw: windows.append(len(window)) or decode(window, **kw)
    pieces = stream(tok, ids)
    # the window: the run emitted last (left context) and the pending one, each at most _MAX_PENDING + 1
    assert max(windows) <= 2 * (IncrementalDetokenizer._MAX_PENDING + 1) < len(ids)
    assert "".join(pieces) == decode(ids) and set("".join(pieces)) == {"\ufffd"}
