import pytest

from tests.text.tokenizer_fixtures import train_byte_level_bpe


@pytest.fixture(scope="module")
def chatml_bpe():
    """A byte-level BPE trained like Qwen2's (ChatML specials), shared by the tokenizer and template tests."""
    return train_byte_level_bpe("qwen2")
