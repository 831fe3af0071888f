"""Constrained decoding with xgrammar: tool_choice required / named / auto-with-tools and
response_format json_object / json_schema become per-request logits processors.

A processor sees each row's generated ids and masks the tokens the grammar forbids next. It keeps
a small pool of matchers keyed by the history they have accepted: the n samples of one request
share the processor, and a speculative verify asks for several rows of one sequence whose
histories differ by the draft tokens, so a processor finds the matcher with the longest common
prefix and rolls it back or forward instead of assuming one history.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass

import torch

from ..util import common_prefix
from .errors import APIError
from .glm_tools import taught_spacing
from .tools import ToolSpec

try:
    import xgrammar as xgr
    from xgrammar import structural_tag as st
except ImportError:  # the server still runs; constrained requests get a clear error
    xgr = None

MAX_ROLLBACK = 64  # beyond this a fresh matcher replays the history instead
# Unbounded whitespace lets a weak model loop on spaces forever inside a constrained object.
MAX_WHITESPACE = 4


@dataclass(frozen=True)
class CallFraming:
    """How a call format frames calls: what opens one, what ends reasoning the prompt opened (and
    what follows that end), and what separates parallel calls."""
    opens: str
    reasoning_end: str
    after_reasoning: str
    between_calls: str


_QWEN = CallFraming("<tool_call>", "</think>", "\n\n", "\n")
# Gemma 4 writes calls straight after its thought channel and after each other (the template's turns).
# GLM / Laguna: "</think>\n" before the calls, one call per <tool_call> block, a newline between blocks.
FRAMINGS = {"hermes": _QWEN, "xml": _QWEN, "gemma4": CallFraming("<|tool_call>", "<channel|>", "", ""),
            "glm": CallFraming("<tool_call>", "</think>", "\n", "\n")}
# A Gemma 4 argument may not hold a control marker: <tool_call|> inside a string would end the call.
GEMMA_ARGUMENT_EXCLUDES = ["<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>"]
# Nor may an arg_value: </tool_call> would end the call, </assistant> the turn (a stop string for Laguna).
GLM_ARGUMENT_EXCLUDES = ["<tool_call>", "</tool_call>", "</assistant>"]


class GrammarFactory:
    """Per tokenizer: xgrammar's vocabulary view and compiler, built on first use (slow for big vocabularies)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, max(vocab_size, tokenizer.vocab_size), sorted(eos_ids)
        self._compiler = None
        self._glm_framing: CallFraming | None = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        if xgr is None:
            raise APIError(400, "constrained decoding (tool_choice required/named, response_format) needs the "
                                "xgrammar package: pip install xgrammar")
        with self._lock:
            if self._compiler is None:
                vocab = [self.tokenizer.id_to_token(i) or "" for i in range(self.tokenizer.vocab_size)]
                backend = self.tokenizer.backend.to_str()
                try:
                    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend)
                except Exception:  # an unknown layout: treat tokens as raw text
                    meta = {"vocab_type": xgr.VocabType.RAW, "add_prefix_space": False}
                info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=self.vocab_size,
                                         stop_token_ids=self.eos_ids, add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    # ------------------------------------------------------------------ grammars
    def response_format(self, fmt: dict, param: str = "response_format"):
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in (None, "text"):
            return None
        compiler = self._get_compiler()
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "json_schema":
            spec = fmt.get("json_schema") if isinstance(fmt.get("json_schema"), dict) else fmt
            schema = spec.get("schema")
            if schema is None:
                schema = {"type": "object"}
            if not isinstance(schema, (dict, bool)):
                raise APIError(400, f"{param}.json_schema.schema must be a JSON schema object", param=param)
            try:
                return compiler.compile_json_schema(json.dumps(schema), strict_mode=False,
                                                    max_whitespace_cnt=MAX_WHITESPACE)
            except Exception as e:
                raise APIError(400, f"{param}: cannot compile the JSON schema: {e}", param=param) from e
        raise APIError(400, f"{param}.type must be text, json_object or json_schema, not {kind!r}", param=param)

    def tool_calls(self, tools: list[ToolSpec], choice: str, fmt: str, parallel: bool, in_reasoning: bool,
                   reasoning_closed: bool = False):
        """choice: 'required', 'auto' or a tool name (already checked to exist). reasoning_closed: the
        prompt ends in the reasoning end tag itself (Laguna with thinking off), so what the template
        writes after that tag comes first."""
        compiler = self._get_compiler()
        chosen = tools if choice in ("auto", "required") else [t for t in tools if t.name == choice]
        framing = self._framing(fmt)
        tags = [_tag(t, fmt) for t in chosen]
        if choice == "auto":
            body = st.TriggeredTagsFormat(triggers=[framing.opens], tags=tags, stop_after_first=not parallel)
        else:
            body = st.TagsWithSeparatorFormat(tags=tags, separator=framing.between_calls, at_least_one=True,
                                              stop_after_first=not parallel or choice != "required")
            if in_reasoning:  # the prompt opened reasoning: free reasoning first, then the calls
                elements = [st.TagFormat(begin="", content=st.AnyTextFormat(), end=framing.reasoning_end)]
                if framing.after_reasoning:
                    elements.append(st.ConstStringFormat(value=framing.after_reasoning))
                body = st.SequenceFormat(elements=[*elements, body])
            elif reasoning_closed and framing.after_reasoning:
                body = st.SequenceFormat(elements=[st.ConstStringFormat(value=framing.after_reasoning), body])
        try:
            return compiler.compile_structural_tag(xgr.StructuralTag(format=body))
        except Exception as e:
            raise APIError(400, f"tools: cannot build a grammar from the tool schemas: {e}", param="tools") from e

    def _framing(self, fmt: str) -> CallFraming:
        """The format's framing, with the spacing the model's template writes where it varies by model."""
        if fmt != "glm":
            return FRAMINGS[fmt]
        if self._glm_framing is None:
            spacing = taught_spacing(getattr(self.tokenizer, "chat_templates", {}))
            default = FRAMINGS[fmt]
            self._glm_framing = default if spacing is None else dataclasses.replace(
                default, after_reasoning=spacing[0], between_calls=spacing[1])
        return self._glm_framing

    def processor(self, compiled, n: int) -> GrammarProcessor:
        return GrammarProcessor(compiled, self.vocab_size, pool=n + 1)


def _tag(tool: ToolSpec, fmt: str):
    schema = tool.parameters or {"type": "object"}
    if fmt == "gemma4":
        try:
            content = st.JSONSchemaFormat(json_schema=template_order(schema), style="gemma",
                                          max_whitespace_cnt=MAX_WHITESPACE, excludes=GEMMA_ARGUMENT_EXCLUDES)
        except ValueError as e:  # pydantic's error for a style this xgrammar lacks
            raise APIError(400, "Gemma 4 tool calls need xgrammar >= 0.2.9 (its 'gemma' argument style): "
                                "pip install -U xgrammar", param="tools") from e
        return st.TagFormat(begin=f"<|tool_call>call:{tool.name}", content=content, end="<tool_call|>")
    if fmt == "glm":  # the name, then <arg_key>/<arg_value> pairs in the schema's order
        content = st.JSONSchemaFormat(json_schema=schema, style="glm_xml", max_whitespace_cnt=MAX_WHITESPACE,
                                      excludes=GLM_ARGUMENT_EXCLUDES)
        return st.TagFormat(begin=f"<tool_call>{tool.name}", content=content, end="</tool_call>")
    if fmt == "xml":
        return st.TagFormat(begin=f"<tool_call>\n<function={tool.name}>\n",
                            content=st.JSONSchemaFormat(json_schema=schema, style="qwen_xml"),
                            end="\n</function>\n</tool_call>")
    return st.TagFormat(begin='<tool_call>\n{"name": ' + json.dumps(tool.name) + ', "arguments": ',
                        content=st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_WHITESPACE),
                        end="}\n</tool_call>")


def template_order(schema):
    """The schema with every "properties" in key order: xgrammar wants an object's members in the
    schema's order, and Gemma 4's template teaches them sorted (dictsort)."""
    if isinstance(schema, list):
        return [template_order(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: template_order(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = dict(sorted(out["properties"].items()))
    return out


class GrammarProcessor:
    def __init__(self, compiled, vocab_size: int, pool: int):
        self.compiled, self.vocab_size, self.pool_size = compiled, vocab_size, pool
        self.pool: list[tuple[object, list[int]]] = []
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def _matcher(self, history: list[int]):
        best, best_lcp = None, -1
        for entry in self.pool:
            lcp = common_prefix(entry[1], history)
            if lcp > best_lcp:
                best, best_lcp = entry, lcp
        need_rollback = best is None or best_lcp < len(best[1])
        if need_rollback and (len(self.pool) < self.pool_size or len(best[1]) - best_lcp > MAX_ROLLBACK):
            if len(self.pool) >= self.pool_size:
                self.pool.remove(best)
            best, best_lcp = (xgr.GrammarMatcher(self.compiled), []), 0
            self.pool.append(best)
        matcher, accepted = best
        if len(accepted) > best_lcp:
            matcher.rollback(len(accepted) - best_lcp)
            del accepted[best_lcp:]
        for token in history[best_lcp:]:
            if matcher.is_terminated() or not matcher.accept_token(token):
                return None  # a rejected draft's row: its logits are discarded, nothing to enforce
            accepted.append(token)
        return matcher

    def __call__(self, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        matcher = self._matcher(history)
        if matcher is None:
            return logits
        if matcher.is_terminated():
            return logits
        matcher.fill_next_token_bitmask(self.bitmask)
        row = logits[: self.vocab_size].unsqueeze(0)
        xgr.apply_token_bitmask_inplace(row, self.bitmask.to(logits.device))
        if logits.shape[0] > self.vocab_size:
            logits[self.vocab_size:] = float("-inf")
        return logits


class BanTokens:
    """tool_choice none: the model may not open a tool call."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def __call__(self, history: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.token_ids] = float("-inf")
        return logits
