"""Gemma 4's vocabulary through GGUF: `lucebox convert` writes a Gemma-style tokenizer.json (SentencePiece-like
BPE with byte fallback and Gemma 4's control tokens) as llama.cpp's "gemma4" tokenizer model, and the GGUF
tokenizer read back encodes, decodes and renders the real Gemma 4 chat template as the HF tokenizer does;
generation ends on <eos>, <turn|> and <|tool_response> (a tool call waits for its result), as in llama.cpp."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader, TokenType

from lucebox import LLM
from lucebox.convert import convert_hf_to_gguf
from lucebox.model.loader import load_model
from tests.conftest import TRAINING_TEXT, build_hf_model
from tests.model.test_gguf_gemma4 import SPECS

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "gemma4_chat_template.jinja").read_text()
# Gemma 4's special tokens in the order of its vocabulary's first ids (padding, eos, bos, unknown, then tags)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
            "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
            "<|image|>", "<|audio|>", "<|video|>"]
TEXTS = ["Hello world", "  two spaces\n\n\nand newlines\n", "def f(x):\n    return x * 2  # ok",
         "Über 東京 café — emoji 🙂 and ñ", "<|turn>user\nhi<turn|>\n<|turn>model\n", "trailing space ",
         '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>']


def gemma_tokenizer_dir(out: Path) -> Path:
    """A tokenizer.json laid out like Gemma's: control tokens first, the 256 <0xXX> byte pieces, BPE pieces
    trained on text whose spaces are U+2581, no pre-tokenizer, <bos> added by the post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "\u2581")
    trained.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
    trained.train_from_iterator([TRAINING_TEXT], trainers.BpeTrainer(vocab_size=260, show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    vocab = {token: i for i, token in enumerate([*SPECIALS, *(f"<0x{b:02X}>" for b in range(256))])}
    for token in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.add_special_tokens(SPECIALS)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-vocab")
    tok_dir = gemma_tokenizer_dir(root / "tok")
    hf_dir = build_hf_model("qwen3", root / "hf", tok_dir, **dict(SPECS["moe"], eos_token_id=[1, 5]))
    return hf_dir, convert_hf_to_gguf(hf_dir, root / "gemma4.gguf", "q8_0")


def test_the_vocabulary_is_written_as_llama_cpp_s_gemma4_tokenizer(converted):
    fields = {k: f.contents() for k, f in GGUFReader(converted[1]).fields.items() if k.startswith("tokenizer.")}
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert fields["tokenizer.ggml.model"] == "gemma4" and fields["tokenizer.ggml.merges"]
    assert fields["tokenizer.ggml.add_space_prefix"] is False and fields["tokenizer.ggml.add_bos_token"] is True
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (2, 1)
    kind = {token: types[i] for i, token in enumerate(tokens)}
    assert kind["<0x41>"] == TokenType.BYTE and kind["<turn|>"] == TokenType.CONTROL
    assert kind["<|tool_call>"] == TokenType.USER_DEFINED and kind['<|"|>'] == TokenType.USER_DEFINED  # rendered
    assert fields["tokenizer.chat_template"] == TEMPLATE


def test_the_gguf_tokenizer_encodes_and_decodes_as_the_hf_one(converted):
    hf, ours = load_model(str(converted[0])).tokenizer, load_model(str(converted[1])).tokenizer
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text
    assert ours.encode("a")[0] == 2  # <bos>
    # llama.cpp renders the tool-call and channel tags whatever it skips (its converter marks them
    # user-defined): the server's parsers read them from the text
    call = TEXTS[-1]
    assert ours.decode(ours.encode(call)) == call and ours.decode(ours.encode("<|turn>x")) == "x"


def test_the_chat_template_renders_the_same(converted):
    hf, ours = load_model(str(converted[0])).tokenizer, load_model(str(converted[1])).tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    for thinking in (False, True):
        kwargs = dict(add_generation_prompt=True, enable_thinking=thinking)
        rendered = ours.apply_chat_template(messages, **kwargs)
        assert rendered == hf.apply_chat_template(messages, **kwargs) and "<|turn>user\nhi there<turn|>" in rendered


def test_generation_ends_on_eos_end_of_turn_and_tool_response(converted):
    loaded = load_model(str(converted[1]))
    ends = {loaded.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("<eos>", "<turn|>", "<|tool_response>")}
    assert ends == {1, 5, 13}
    assert ends <= LLM(str(converted[1]), block_size=4, max_num_seqs=1).engine.eos_token_ids
