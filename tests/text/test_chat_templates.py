"""Chat templates render exactly like transformers' (extra kwargs, named templates, generation tags, a
.jinja file over the config's), and bad or hostile templates are clear request errors."""

import pytest

from lucebox.errors import LuceboxError, RequestError
from lucebox.text.tokenizer import Tokenizer
from tests.text.tokenizer_fixtures import (LLAMA3_TEMPLATE, MESSAGES, QWEN_TEMPLATE, TOOLS, added_token_json,
                                       write_hf_dir)


@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("template", [QWEN_TEMPLATE, LLAMA3_TEMPLATE], ids=["qwen", "llama3"])
def test_chat_template_renders_exactly_like_transformers(tmp_path, chatml_bpe, template, with_tools):
    transformers = pytest.importorskip("transformers")
    d = write_hf_dir(
        tmp_path, chatml_bpe, chat_template=template, bos_token="<|begin_of_text|>",
        eos_token=added_token_json("<|im_end|>"), pad_token="<|endoftext|>",
    )
    tools = TOOLS if with_tools else None
    expected = transformers.PreTrainedTokenizerFast.from_pretrained(d).apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert Tokenizer.from_hf_dir(d).apply_chat_template(MESSAGES, tools=tools) == expected


def test_chat_template_extra_kwargs_reach_the_template_like_transformers(tmp_path, chatml_bpe):
    transformers = pytest.importorskip("transformers")
    d = write_hf_dir(tmp_path, chatml_bpe, chat_template=QWEN_TEMPLATE, eos_token="<|im_end|>")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    ours = Tokenizer.from_hf_dir(d)
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(
            MESSAGES[:2], tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=False
        )
        got = ours.apply_chat_template(MESSAGES[:2], add_generation_prompt=add_generation_prompt, enable_thinking=False)
        assert got == expected
    assert ours.apply_chat_template(MESSAGES[:2], enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_named_chat_templates_pick_default_or_tool_use_like_transformers(tmp_path, chatml_bpe):
    transformers = pytest.importorskip("transformers")
    templates = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                 {"name": "tool_use", "template": "tools:{{ tools[0].function.name }}"}]
    d = write_hf_dir(tmp_path, chatml_bpe, chat_template=templates)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    ours = Tokenizer.from_hf_dir(d)
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(MESSAGES, tools=tools) == hf.apply_chat_template(
            MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True
        )
    assert ours.apply_chat_template(MESSAGES, chat_template="default", tools=TOOLS).startswith("plain:")


def test_generation_tags_render_their_body_like_transformers(tmp_path, chatml_bpe):
    transformers = pytest.importorskip("transformers")
    template = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}" \
               "{% else %}{{ m.role }}{% endif %}{% endfor %}"
    d = write_hf_dir(tmp_path, chatml_bpe, chat_template=template)
    expected = transformers.PreTrainedTokenizerFast.from_pretrained(d).apply_chat_template(MESSAGES, tokenize=False)
    assert Tokenizer.from_hf_dir(d).apply_chat_template(MESSAGES, add_generation_prompt=False) == expected


def test_chat_template_jinja_file_overrides_the_config_template(tmp_path, chatml_bpe):
    d = write_hf_dir(tmp_path, chatml_bpe, chat_template="from config")
    (tmp_path / "chat_template.jinja").write_text("from file {{ messages | length }}", encoding="utf-8")
    assert Tokenizer.from_hf_dir(d).apply_chat_template(MESSAGES) == "from file 6"


def test_missing_chat_template_is_a_request_error(chatml_bpe):
    tok = Tokenizer.from_tokenizers(chatml_bpe)
    with pytest.raises(RequestError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_raise_exception_in_template_is_a_request_error_with_its_message(tmp_path, chatml_bpe):
    d = write_hf_dir(tmp_path, chatml_bpe, chat_template=LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>")
    two_calls = dict(MESSAGES[2], tool_calls=MESSAGES[2]["tool_calls"] * 2)
    with pytest.raises(RequestError, match="only supports single tool-calls"):
        Tokenizer.from_hf_dir(d).apply_chat_template([MESSAGES[1], two_calls])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ messages.__class__.__init__.__globals__['sys'].modules['os'].system('id') }}",
        "{% set ns = namespace(__class__=1) %}{{ ns }}",
        "{{ dict.__class__.__mro__ }}",
        "{{ [].append.__self__.__class__.__base__.__subclasses__() }}",
    ],
)
def test_sandbox_blocks_python_internals_in_templates(chatml_bpe, template):
    tok = Tokenizer.from_tokenizers(chatml_bpe, chat_template=template)
    with pytest.raises(LuceboxError):
        tok.apply_chat_template(MESSAGES)


def test_sandbox_renders_unsafe_attribute_access_as_nothing(chatml_bpe):
    tok = Tokenizer.from_tokenizers(chatml_bpe, chat_template="[{{ ''.__class__ }}][{{ messages.pop }}]")
    out = tok.apply_chat_template(MESSAGES)
    assert "class" not in out and "method" not in out
    with pytest.raises(LuceboxError):  # the immutable sandbox refuses to mutate the caller's messages
        Tokenizer.from_tokenizers(chatml_bpe, chat_template="{{ messages.pop() }}").apply_chat_template(MESSAGES)
