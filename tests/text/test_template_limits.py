"""Chat templates are untrusted programs: renders are bounded in time and size, the sandbox holds
against known escapes, and request-supplied templates are off unless the server allows them."""
from __future__ import annotations

import time
import tracemalloc

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lucebox.errors import RequestError
from lucebox.text import template_sandbox
from lucebox.text.chat_template import MAX_REQUEST_TEMPLATE_BYTES, check_request_template, render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]
PEAK_BYTES = 256 << 20


@pytest.fixture
def short_deadline(monkeypatch):
    monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 0.5)


def render_bounded(source: str) -> tuple[str | RequestError, float, int]:
    tracemalloc.start()
    start = time.monotonic()
    try:
        try:
            outcome = render_chat_template(source, MESSAGES)
        except RequestError as e:
            outcome = e
        return outcome, time.monotonic() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


RUNAWAY = {
    "nested_loops_1e10": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "exponential_macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "recursive_loop_fanout": "{% for x in range(3) recursive %}{{ loop(range(100000)) }}{% endfor %}",
    "map_over_a_big_list": "{% for i in range(100000) %}{{ range(100000)|map('string')|list|length }}{% endfor %}",
}


@pytest.mark.parametrize("source", RUNAWAY.values(), ids=RUNAWAY.keys())
def test_a_runaway_template_stops_at_the_deadline(source, short_deadline):
    outcome, seconds, _ = render_bounded(source)
    assert isinstance(outcome, RequestError)
    assert "too long" in str(outcome) or "recurses" in str(outcome)
    assert seconds < 2.0


def test_the_default_deadline_is_a_few_seconds():
    start = time.monotonic()
    with pytest.raises(RequestError, match="took too long"):
        render_chat_template(RUNAWAY["nested_loops_1e10"], MESSAGES)
    assert template_sandbox.RENDER_SECONDS - 0.1 < time.monotonic() - start < template_sandbox.RENDER_SECONDS + 2


HUGE = {
    "string_times_1e8": "{{ 'x' * 100000000 }}",
    "list_times_1e8": "{{ ([1] * 100000000)|length }}",
    "doubling_with_tilde": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}{{ ns.s|length }}",
    "doubling_with_plus": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                          "{% endfor %}",
    "big_power": "{{ 2 ** 100000000 }}",
    "squaring_loop": "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "center_method": "{{ 'x'.center(1000000000) }}",
    "center_filter": "{{ 'x'|center(1000000000) }}",
    "format_width_literal": "{{ '{:>1000000000}'.format('x') }}",
    "format_width_argument": "{{ '{:>{}}'.format('x', 1000000000) }}",
    "percent_width": "{{ '%1000000000d' % 1 }}",
    "percent_star_width": "{{ '%*d' % (1000000000, 1) }}",
    "format_filter_width": "{{ '%1000000000d'|format(1) }}",
    "replace_blowup": "{{ ('x' * 1000000).replace('', 'y' * 40) }}",
    "expandtabs_blowup": "{{ ('\t' * 1000000).expandtabs(1000) }}",
    "indent_blowup": "{{ ('x\n' * 1000000)|indent(1000) }}",
    "tojson_indent": "{{ messages|tojson(indent=100000000) }}",
    "output_by_repetition": "{% for i in range(100000) %}{% for j in range(100) %}{{ 'x' * 5000 }}"
                            "{% endfor %}{% endfor %}",
    "set_block_by_repetition": "{% set s = 'x' * 1000000 %}{% set big %}{% for i in range(100000) %}{{ s }}"
                               "{% endfor %}{% endset %}{{ big|length }}",
    "slow_filter_input": "{{ ('x.com ' * 1000000)|urlize|length }}",
}


@pytest.mark.parametrize("source", HUGE.values(), ids=HUGE.keys())
def test_a_template_making_huge_values_is_refused_before_memory_blows_up(source):
    outcome, seconds, peak = render_bounded(source)
    assert isinstance(outcome, RequestError), outcome[:100]
    assert "budget" in str(outcome) or "over" in str(outcome) or "limited" in str(outcome)
    assert peak < PEAK_BYTES
    assert seconds < 3.0


def test_deep_macro_recursion_is_a_request_error():
    with pytest.raises(RequestError, match="recurses too deeply"):
        render_chat_template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", MESSAGES)


ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ self.__dict__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ ''|attr('__class__')|attr('__mro__') }}",
    "{{ ''|attr('format')('{0.__class__.__mro__}', '') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ '{0.__globals__}'.format(raise_exception) }}",
    "{{ '{a.__class__}'.format_map({'a': ''}) }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{% for x in [1] %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
    "{{ namespace(__class__=1) }}",
    "{{ messages.append(1) }}{{ messages }}",
    "{{ lipsum.__globals__ }}",
    "{{ range.__globals__ }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_known_sandbox_escapes_are_refused_or_harmless(source):
    outcome, seconds, _ = render_bounded(source)
    if not isinstance(outcome, RequestError):
        for leak in ("<class", "module", "function", "built-in", "__", "Undefined"):
            assert leak not in outcome.replace("[Undefined]", ""), outcome[:200]
    assert seconds < 3.0  # a loaded CI machine; these take milliseconds


def test_ordinary_templates_render_as_plain_jinja_renders_them():
    source = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content|trim }}{% if not loop.last %}\n{% endif %}"
              "{% endfor %}{% for k, v in tools[0].items() recursive %}{{ k }}{% endfor %}"
              "{{ '%s-%d'|format('a', 3) }}{{ 'x'.center(5) }}{{ messages|map(attribute='role')|join(',') }}"
              "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
              "{{ ('ab' ~ 'cd') * 2 }}{{ [1, 2] + [3] }}")
    tools = [{"type": "function", "function": {"name": "f"}}]
    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source).render(
        messages=MESSAGES * 3, tools=tools, add_generation_prompt=True)
    assert render_chat_template(source, MESSAGES * 3, tools=tools) == reference
    assert reference.startswith("<|user|>hi<|user|>hi")


def test_a_long_conversation_renders_within_the_budget():
    messages = [{"role": "user", "content": "word " * 200_000}] * 20  # 20 MB of input, more than the base
    out = render_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}", messages)
    assert len(out) == 20 * 1_000_000


def test_a_request_may_name_one_of_the_models_templates():
    check_request_template({"chat_template": "tool_use", "enable_thinking": False}, {"default": "x", "tool_use": "y"},
                           allow_custom=False)
    check_request_template({"enable_thinking": True}, {"default": "x"}, allow_custom=False)


def test_a_request_template_text_is_refused_unless_the_server_allows_it():
    with pytest.raises(RequestError, match="--allow-request-chat-template"):
        check_request_template({"chat_template": "{{ 1 }}"}, {"default": "x"}, allow_custom=False)
    check_request_template({"chat_template": "{{ 1 }}"}, {"default": "x"}, allow_custom=True)


def test_an_allowed_request_template_is_limited_in_size():
    big = "x" * (MAX_REQUEST_TEMPLATE_BYTES + 1)
    with pytest.raises(RequestError, match="byte limit"):
        check_request_template({"chat_template": big}, {}, allow_custom=True)
    with pytest.raises(RequestError, match="must be a string"):
        check_request_template({"chat_template": ["x"]}, {}, allow_custom=True)
