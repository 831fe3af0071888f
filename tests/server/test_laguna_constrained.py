"""Constrained decoding of Laguna's arg_key tool calls (tests/server/laguna_server.py's server): tool_choice
required and named hold an untrained model to the format, the grammar takes reasoning then calls as XS.2's
template writes them, and Laguna S 2.1's template (tests/fixtures/laguna_s21_chat_template.jinja) writes the
same tags without newlines, which its output's parsing and the grammar follow."""
from __future__ import annotations

import json

import xgrammar as xgr

from lucebox.server.constrain import GrammarFactory
from lucebox.server.glm_tools import taught_spacing
from lucebox.server.tools import ToolSpec, tool_format
from lucebox.text.chat_template import render_chat_template
from tests.server.laguna_server import (  # noqa: F401  (server: the module's fixture)
    CALL, SCHEMAS, TEMPLATE, THOUGHT, TIGHT_TEMPLATE, TURN_END, WEATHER, oai, parse, server)
from tests.server_helpers import assert_tool_choice_holds_the_format


# ---------------------------------------------------------------------------------------------- constrained
def test_tool_choice_required_and_named_hold_an_untrained_model_to_arg_key_calls(server):
    assert_tool_choice_holds_the_format(oai(server), WEATHER)


def test_the_arg_key_grammar_takes_reasoning_then_calls_as_the_template_writes_them(server):
    llm = server.llm
    factory = GrammarFactory(llm.tokenizer, llm.engine.model.config.vocab_size, llm.engine.eos_token_ids)
    tools = [ToolSpec("get_weather", parameters=WEATHER["function"]["parameters"])]
    compiled = factory.tool_calls(tools, "required", "glm", parallel=True, in_reasoning=True)

    def accepts(text: str, compiled=compiled) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.token_to_id(TURN_END)]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()
    assert accepts(f"\n{THOUGHT}\n</think>\n{CALL}")
    assert accepts(f"\n{THOUGHT}\n</think>\n{CALL}\n{CALL}")  # parallel calls, one block each
    assert accepts(f"{THOUGHT}</think>\n" + CALL.replace("\n", ""))  # the tight form of Laguna S 2.1
    assert not accepts(f"{THOUGHT}</think>\n" + CALL.replace("<arg_value>3<", "<arg_value>three<"))
    assert not accepts(f"{THOUGHT}</think>\n" + CALL.replace("Paris", f"Paris{TURN_END}"))
    assert not accepts(f'{THOUGHT}</think>\n<tool_call>\n{{"name": "get_weather", "arguments": {{}}}}\n</tool_call>')
    # Thinking off: the prompt ends in </think>, and the template's newline after it comes first.
    off = factory.tool_calls(tools, "required", "glm", parallel=False, in_reasoning=False, reasoning_closed=True)
    assert accepts(f"\n{CALL}", off) and not accepts(CALL, off) and not accepts(f"\n{CALL}\n{CALL}", off)


class _WithTemplate:
    """A tokenizer as it is, with another chat template."""

    def __init__(self, tokenizer, template: str):
        self._tokenizer, self.chat_templates = tokenizer, {"default": template}

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_laguna_s21_writes_the_tags_without_newlines_and_constrained_calls_follow_it(server):
    assert taught_spacing({"default": TEMPLATE}) == ("\n", "\n")
    assert taught_spacing({"default": TIGHT_TEMPLATE}) == ("", "")
    assert tool_format({"default": TIGHT_TEMPLATE}) == "glm"
    tight_call = CALL.replace("\n", "")
    # Its default is thinking on: the prompt ends in <think>, and the output parses as XS.2's does.
    llm = server.llm
    prompt = render_chat_template(TIGHT_TEMPLATE, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt.endswith("<user>hi</user>\n<assistant><think>")
    out = parse(f"{THOUGHT}</think>{tight_call}{tight_call}", in_reasoning=True, param_schemas=SCHEMAS)
    assert out.reasoning == THOUGHT and out.content == ""
    assert [(n, json.loads(a)) for n, a in out.calls] == [("get_weather", {"city": "Paris", "days": 3})] * 2
    factory = GrammarFactory(_WithTemplate(llm.tokenizer, TIGHT_TEMPLATE), llm.engine.model.config.vocab_size,
                             llm.engine.eos_token_ids)
    tools = [ToolSpec("get_weather", parameters=WEATHER["function"]["parameters"])]
    compiled = factory.tool_calls(tools, "required", "glm", parallel=True, in_reasoning=True)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.token_to_id(TURN_END)]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()
    assert accepts(f"{THOUGHT}</think>{tight_call}{tight_call}")
    assert not accepts(f"{THOUGHT}</think>\n{tight_call}")
