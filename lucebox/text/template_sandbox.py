"""A jinja2 sandbox whose renders are bounded in time and size.

jinja2's sandbox stops attribute escapes but not `{{ 'x' * 10**9 }}` or three nested 100k-item loops.
A render cannot be killed from outside (it is Python running on the caller's thread), so it is
bounded from inside: every loop step, call, operator, attribute and filter ticks a per-render
budget that checks a deadline, every value an operator, call or filter makes is weighed (characters
of its strings plus items of its containers) before it is made where it could be huge and after,
and the output is counted as it is joined. A render over budget raises TemplateBudgetError.
"""
from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import wraps
from typing import Any

import jinja2.nodes as nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 3.0
BASE_CHARS = 8 << 20  # plus a multiple of the inputs: a template may repeat what it is given
INPUT_FACTOR = 4
MAX_INT_BITS = 1 << 16
# Filters that run at C speed (or close) however long their input; the others work item by item in
# Python (urlize on 400K characters takes 2 s), so their input's length is capped to keep a single
# call from running far past the deadline.
FAST_FILTERS = frozenset({"abs", "attr", "bool", "capitalize", "center", "count", "d", "default", "e", "escape",
                          "first", "float", "indent", "int", "items", "join", "last", "length", "list", "lower",
                          "replace", "reverse", "round", "safe", "string", "striptags", "tojson", "trim",
                          "truncate", "upper", "wordcount"})
SLOW_FILTER_ITEMS = {"urlize": 1 << 14, "wordwrap": 1 << 16}
DEFAULT_SLOW_FILTER_ITEMS = 1 << 18
_LOOP_FILTER = "lucebox_loop_budget"
_CONCAT_FILTER = "lucebox_checked_concat"
_DIGITS = re.compile(r"\d+")


class TemplateBudgetError(Exception):
    """The render went over its time or size budget (render_chat_template turns it into a RequestError)."""


@dataclass
class RenderBudget:
    deadline: float
    max_chars: int

    @classmethod
    def for_inputs(cls, input_chars: int, seconds: float | None = None) -> "RenderBudget":
        seconds = RENDER_SECONDS if seconds is None else seconds
        return cls(time.monotonic() + seconds, BASE_CHARS + INPUT_FACTOR * input_chars)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError("the chat template took too long to render (a runaway loop or recursion?)")

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise TemplateBudgetError(f"the chat template {what} would be over {self.max_chars} characters")


_budget: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("lucebox_template_budget", default=None)


def _current() -> RenderBudget:
    budget = _budget.get()
    if budget is None:  # rendering outside `bounded` is a bug, not a reason to run unbounded
        raise TemplateBudgetError("chat templates render only inside a render budget")
    return budget


class bounded:
    """`with bounded(budget): template.render(...)` — the budget of renders on this thread / task."""

    def __init__(self, budget: RenderBudget):
        self.budget = budget

    def __enter__(self):
        self.token = _budget.set(self.budget)
        return self.budget

    def __exit__(self, *exc):
        _budget.reset(self.token)


def weight(value: Any, limit: int) -> int:
    """Characters of strings plus items of containers inside `value`, counted up to just past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += len(item)
            stack.extend(item)
        elif isinstance(item, Mapping):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > 64:
            total += item.bit_length() // 3  # about its decimal digits
    return total


def _checked(value: Any, what: str) -> Any:
    budget = _current()
    budget.check_size(weight(value, budget.max_chars), what)
    return value


def _check_int_args(args, kwargs, what: str) -> None:
    budget = _current()
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.max_chars:
            raise TemplateBudgetError(f"the chat template passes {value:.3g} to {what}, over the size budget")


def _check_format_spec(fmt: Any, what: str) -> None:
    """Widths and precisions written into a format string ('{:>999999999}', '%999999999d')."""
    if isinstance(fmt, str):
        budget = _current()
        budget.check_size(len(fmt), what)
        for digits in _DIGITS.findall(fmt):
            if len(digits) > 12 or int(digits) > budget.max_chars:
                raise TemplateBudgetError(f"the chat template asks {what} for a width of {digits}, "
                                          "over the size budget")


def _estimate(name: str, obj: Any, args: tuple, kwargs: dict) -> int | None:
    """The size of what a str method / filter named `name` will make, for those that can multiply their input."""
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        return max(first, len(obj) if isinstance(obj, str) else 0)
    if name == "expandtabs" and isinstance(obj, str):
        tab = first if isinstance(first, int) else kwargs.get("tabsize", 8)
        return len(obj) * max(1, tab if isinstance(tab, int) else 8)
    if name == "indent" and isinstance(obj, str):
        width = first if first is not None else kwargs.get("width", 4)
        return len(obj) + (obj.count("\n") + 1) * (len(width) if isinstance(width, str) else int(width or 0))
    if name == "replace" and isinstance(obj, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        hits = obj.count(old) if old else len(obj) + 1
        return len(obj) + hits * len(new)
    return None


class _Guards(NodeTransformer):
    """Route every for-loop's iterable and every `~` through the budget (jinja has no hooks for these)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT_FILTER, [], [], None, None,
                            lineno=node.lineno)


def _loop_budget(iterable) -> Iterator[Any]:
    budget = _current()
    for item in iterable:
        budget.tick()
        yield item


def _checked_concat(parts) -> str:
    budget = _current()
    pieces = [str(p) for p in parts]
    budget.check_size(sum(map(len, pieces)), "`~` result")
    return "".join(pieces)


def _guard_filter(name: str, func):
    takes_context = getattr(func, "jinja_pass_arg", None) is not None  # then the value is the second argument

    @wraps(func)  # keeps jinja_pass_arg, so context-taking filters still get their context
    def guarded(*args, **kwargs):
        budget = _current()
        budget.tick()
        value, rest = (args[1], args[2:]) if takes_context else (args[0], args[1:])
        _check_int_args(rest, kwargs, f"the {name} filter")
        if name not in FAST_FILTERS and hasattr(value, "__len__"):
            cap = SLOW_FILTER_ITEMS.get(name, DEFAULT_SLOW_FILTER_ITEMS)
            if len(value) > cap:
                raise TemplateBudgetError(f"the chat template gives the {name} filter {len(value)} characters or "
                                          f"items, over lucebox's limit of {cap} for it")
        if name == "format":
            _check_format_spec(value, "the format filter")
        estimate = _estimate(name, value, rest, kwargs)
        if estimate is not None:
            budget.check_size(estimate, f"{name} filter's result")
        result = _checked(func(*args, **kwargs), f"{name} filter's result")
        # map, select, unique... hand back generators that run later: each step of theirs ticks too
        return _loop_budget(result) if isinstance(result, Iterator) else result
    return guarded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with a per-render budget (see the module docstring)."""

    intercepted_binops = frozenset({"+", "*", "**", "%", "//"})

    def __init__(self, **options):
        super().__init__(**options)
        self.globals.pop("lipsum", None)  # lipsum(n=10**9) makes text without ever coming back here
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.filters[_LOOP_FILTER] = _loop_budget
        self.filters[_CONCAT_FILTER] = _checked_concat

    def add_filter(self, name: str, func) -> None:
        self.filters[name] = _guard_filter(name, func)

    def _parse(self, source, name, filename):
        return _Guards().visit(super()._parse(source, name, filename))

    def concat(self, parts) -> str:
        """Joins a render's (or a block's, a macro's) output, counting it before it is joined."""
        budget = _current()
        pieces, total = [], 0
        for piece in parts:
            total += len(piece)
            budget.check_size(total, "output")
            pieces.append(piece)
        return "".join(pieces)

    def getattr(self, obj, attribute):
        _current().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _current().tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, op: str, left, right):
        budget = _current()
        budget.tick()
        limit = budget.max_chars
        if op == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and abs(left).bit_length() * right > MAX_INT_BITS:
                raise TemplateBudgetError("the chat template raises a number to a power over the size budget")
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    budget.check_size(weight(seq, limit) * max(times, 0), "`*` result")
            if isinstance(left, int) and isinstance(right, int) and (
                    left.bit_length() + right.bit_length() > MAX_INT_BITS):
                raise TemplateBudgetError("the chat template multiplies numbers over the size budget")
        if op == "+" and isinstance(left, (str, list, tuple)):
            budget.check_size(weight(left, limit) + weight(right, limit), "`+` result")
        if op == "%" and isinstance(left, str):
            _check_format_spec(left, "`%` formatting")
            _check_int_args(right if isinstance(right, tuple) else (right,), {}, "`%` formatting")
        return _checked(super().call_binop(context, op, left, right), f"`{op}` result")

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's signature: the names must not clash
        budget = _current()
        budget.tick()
        if isinstance(__obj, LoopContext) and args:  # `loop(children)` in a recursive loop
            args = (_loop_budget(args[0]), *args[1:])
        # str.format comes wrapped by the sandbox's own formatter (the bound method is __wrapped__)
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, (str, list, tuple, dict)):
            name = getattr(method, "__name__", "")
            _check_int_args(args, kwargs, f"{type(owner).__name__}.{name}")
            if name in ("format", "format_map") and isinstance(owner, str):
                _check_format_spec(owner, "str.format")
                if name == "format_map" and args and isinstance(args[0], Mapping):
                    _check_int_args(tuple(args[0].values()), {}, "str.format_map")
            estimate = _estimate(name, owner, args, kwargs)
            if name == "join" and isinstance(owner, str) and args and isinstance(args[0], (list, tuple)):
                estimate = weight(args[0], budget.max_chars) * (1 + len(owner))
            if estimate is not None:
                budget.check_size(estimate, f"{name}() result")
        return _checked(super().call(__context, __obj, *args, **kwargs), "call result")

