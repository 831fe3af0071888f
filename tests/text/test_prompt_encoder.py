"""Incremental prompt encoding (text/prompt_encoder.py): every prompt's ids equal a whole encode of
it, whatever it shares with earlier prompts (a growing conversation, an edited one, a truncated
one, several at once, several threads), on byte-level BPE and on a SentencePiece-style (Metaspace)
tokenizer; and the ids it reuses are most of a grown conversation's."""
from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from lucebox.text import prompt_encoder
from lucebox.text.prompt_encoder import PromptEncoder
from lucebox.util import common_prefix
from lucebox.text.tokenizer import Tokenizer as LuceboxTokenizer

ROOT = Path(__file__).resolve().parents[2]
# non-ASCII words too: the pieces' offsets must be characters, not bytes
WORDS = "def class return import self value token cache block graph prefill decode the a of to in wörld 日本語 😀".split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + rng.choice(["\n", "\n\n", "  ", ".", ""])


def chatml(messages: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages) + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def bundled():
    return LuceboxTokenizer.from_hf_dir(ROOT / "models" / "default").backend


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer: Metaspace prepends '▁' to the first piece of a text only."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    rng = random.Random(0)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<start_of_turn>", "<end_of_turn>"])
    tok.train_from_iterator([words(rng, 200) for _ in range(50)], trainer)
    return tok


def conversation_texts(rng: random.Random, turns: int, template=chatml):
    messages = [("system", words(rng, 300))]
    for turn in range(turns):
        messages.append(("user" if turn % 2 == 0 else "assistant", words(rng, rng.randint(20, 400))))
        yield template(messages)


def gemma(messages):
    turns = "".join(f"<start_of_turn>{role}\n{text}<end_of_turn>\n" for role, text in messages)
    return turns + "<start_of_turn>model\n"


@pytest.mark.parametrize("name, template", [("bundled", chatml), ("metaspace", gemma)])
def test_every_prompt_encodes_as_a_whole_encode_does(name, template, request, monkeypatch):
    monkeypatch.setattr(prompt_encoder, "MIN_CHARS", 256)
    backend = request.getfixturevalue(name)
    encoder = PromptEncoder(backend, entries=3)
    assert encoder.splits  # the probe found the split property
    rng = random.Random(1)
    whole = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    texts = list(conversation_texts(rng, 12, template))
    others = list(conversation_texts(random.Random(2), 6, template))
    cases = texts[:6] + others[:3] + texts[6:] + others[3:]  # two conversations interleaved
    edited = texts[8]
    at = len(edited) // 2
    cases += [edited[:at] + "X" + edited[at:],  # an edit in the middle of a cached prompt
              texts[10][:len(texts[10]) // 3],  # a prompt cut short (mid-message)
              texts[11][:texts[11].rindex("<") + 3],  # cut inside a special token
              texts[11], texts[11],  # repeated whole
              words(rng, 400),  # no special token at all
              "<|im_start|>" * 50 + words(rng, 100)]
    for text in cases:
        assert encoder.encode(text) == whole(text)
    assert encoder.reused > encoder.encoded  # most ids came from earlier prompts


def test_a_grown_conversation_encodes_only_what_is_new(bundled):
    encoder = PromptEncoder(bundled)
    texts = list(conversation_texts(random.Random(3), 20))
    for text in texts:
        encoder.encode(text)
    last = bundled.encode(texts[-1], add_special_tokens=False).ids
    new = bundled.encode(texts[-1][texts[-2].rindex("<|im_start|>assistant"):], add_special_tokens=False).ids
    encoded = encoder.encoded
    encoder.encode(texts[-1] + "<|im_start|>user\nmore<|im_end|>\n")
    assert encoder.encoded - encoded <= 16  # the generation prompt and the new message
    assert len(encoder.recent) == 1  # each grown prompt replaced its conversation's previous one
    assert len(new) < len(last) // 5


def test_tokenizers_whose_pieces_read_around_special_tokens_are_encoded_whole():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([words(random.Random(4), 200)], trainers.BpeTrainer(vocab_size=200))
    tok.add_special_tokens([AddedToken("<sep>", lstrip=True, special=True)])  # takes the spaces before it
    encoder = PromptEncoder(tok)
    assert not encoder.splits
    text = " ".join(["<sep>", words(random.Random(5), 3000)] * 2)
    assert encoder.encode(text) == tok.encode(text, add_special_tokens=False).ids and not encoder.recent


def test_threads_encoding_at_once_each_get_their_prompts_ids(bundled):
    encoder = PromptEncoder(bundled, entries=4)
    texts = [list(conversation_texts(random.Random(10 + i), 8)) for i in range(4)]
    wrong = []

    def run(conversation):
        for text in conversation:
            if encoder.encode(text) != bundled.encode(text, add_special_tokens=False).ids:
                wrong.append(text[:40])
    threads = [threading.Thread(target=run, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and len(encoder.recent) <= 4


def test_the_kept_prompts_stay_within_their_bounds(bundled):
    encoder = PromptEncoder(bundled, entries=2, max_chars=30_000)
    for seed in range(6):
        for text in conversation_texts(random.Random(seed), 3):
            encoder.encode(text)
    assert len(encoder.recent) <= 2 and sum(len(e.text) for e in encoder.recent.values()) <= 30_000


@pytest.mark.parametrize("a, b, n", [("", "abc", 0), ("abc", "abc", 3), ("abcx", "abcy", 3),
                                     ("a" * 10000 + "b", "a" * 10000 + "c", 10000), ("a" * 9000, "a" * 5000, 5000),
                                     ([1, 2, 3], [1, 2, 4], 2), (list(range(9000)), list(range(7000)) + [0], 7000)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n
