"""`lucebox bench serve`'s prompts: random text, agent-shaped traces, or a JSONL / ShareGPT file;
sized in tokens by the server's tokenizer where there is one, else by a chars-per-token estimate."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LuceboxError

# Code and prose words: text that tokenises like what the bundled code model and chat models see.
WORDS = ("def return self import class for while if else elif try except with as lambda yield None True False "
         "value index result items count name path file data request response error token cache model "
         "the of and to in is that it for on with as was this be by are from at or an have not which "
         "list dict str int float len range print open read write append update config server client "
         "0 1 2 3 42 100 1024 x y i j n k + - * / = == != < > ( ) [ ] { } : , . ; # ->").split()
ESTIMATED_CHARS_PER_TOKEN = 4.0


class TokenSizer:
    """Counts and cuts text by the model's own tokenizer (lucebox.text.Tokenizer)."""
    exact = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.note = "prompt lengths counted by the model's tokenizer"

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def cut(self, text: str, tokens: int) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < tokens:
            raise ValueError(f"cut: the text holds {len(ids)} tokens, fewer than {tokens}")
        return self.tokenizer.decode(ids[:tokens], skip_special_tokens=False)


class CharSizer:
    """Counts and cuts text at a fixed number of characters per token (measured or guessed)."""
    exact = False

    def __init__(self, chars_per_token: float, note: str):
        self.chars_per_token, self.note = chars_per_token, note

    def count(self, text: str) -> int:
        return max(1, round(len(text) / self.chars_per_token))

    def cut(self, text: str, tokens: int) -> str:
        chars = round(tokens * self.chars_per_token)
        if len(text) < chars:
            raise ValueError(f"cut: the text holds {len(text)} characters, fewer than {chars}")
        return text[:chars]


@dataclass
class BenchRequest:
    """One request of the benchmark. `messages` (role/content dicts) for chat endpoints; `prompt` is
    the same text flattened for /v1/completions. `after`: index of the request that must finish
    before this one is sent (an agent's previous turn)."""
    messages: list[dict]
    prompt: str
    prompt_len: int  # tokens by the sizer (the server's usage replaces it when it reports one)
    output_len: int
    after: int | None = None
    conversation: int = 0
    turn: int = 0
    extra: dict = field(default_factory=dict)


def flatten(messages: list[dict]) -> str:
    """Messages as one completion prompt; a conversation's later turn extends its earlier one."""
    return "".join(f"### {m['role']}\n{m['content']}\n\n" for m in messages)


def words_text(rng: random.Random, tokens: int, sizer) -> str:
    """Random words cut to exactly `tokens` tokens by the sizer."""
    words: list[str] = []
    while True:  # grow until long enough; the 6 chars per token bound overshoots for any real tokenizer
        words += rng.choices(WORDS, k=max(16, tokens * 2))
        text = " ".join(words)
        if len(text) >= 6 * tokens and sizer.count(text) >= tokens:
            return sizer.cut(text, tokens)


def _request(messages: list[dict], output_len: int, sizer, **kw) -> BenchRequest:
    prompt = flatten(messages)
    return BenchRequest(messages, prompt, sizer.count(prompt), output_len, **kw)


def random_requests(num: int, input_len: int, output_len: int, sizer, seed: int) -> list[BenchRequest]:
    """vLLM's `random` dataset, in words: `num` unrelated prompts of `input_len` tokens each."""
    rng = random.Random(seed)
    return [_request([{"role": "user", "content": words_text(rng, input_len, sizer)}], output_len, sizer)
            for _ in range(num)]


def agent_prefix(rng: random.Random, prefix_len: int, sizer) -> str:
    """A system prompt with tool definitions (JSON schemas), cut to `prefix_len` tokens."""
    head = ("You are a coding agent working in a repository. Think step by step, call one tool at a time, "
            "and read each tool's result before the next call.\n# Tools\n")
    tools = []
    text = head
    while sizer.count(text) < prefix_len:
        name = "_".join(rng.choices(WORDS[:60], k=2))
        params = {w: {"type": rng.choice(["string", "integer", "boolean"]), "description": " ".join(rng.choices(WORDS, k=6))}
                  for w in rng.sample(WORDS[:60], 3)}
        tools.append({"type": "function", "function": {"name": f"{name}_{len(tools)}",
                                                       "description": " ".join(rng.choices(WORDS, k=12)),
                                                       "parameters": {"type": "object", "properties": params}}})
        text = head + "\n".join(json.dumps(t) for t in tools)
    return sizer.cut(text, prefix_len)


def agent_requests(num: int, prefix_len: int, suffix_len: int, output_len: int, turns: int, sizer,
                   seed: int) -> list[BenchRequest]:
    """Agent-shaped traces: conversations that all start with one long system prompt (+ tools) and
    grow turn by turn (the user's task; then per turn the assistant's tool call and the tool's
    result), each turn resending the whole history, as agent clients do. Requests are ordered turn
    by turn across conversations, and each turn waits for its conversation's previous one, so a
    server's prefix cache can serve both the shared prefix and each conversation's history."""
    if turns < 1:
        raise LuceboxError(f"--turns must be >= 1, got {turns}")
    rng = random.Random(seed)
    system = {"role": "system", "content": agent_prefix(rng, prefix_len, sizer)}
    conversations = math.ceil(num / turns)
    histories = [[system, {"role": "user", "content": "Task: " + words_text(rng, suffix_len, sizer)}]
                 for _ in range(conversations)]
    requests: list[BenchRequest] = []
    last: dict[int, int] = {}
    for turn in range(turns):
        for c, history in enumerate(histories):
            if len(requests) == num:
                return requests
            if turn:  # the previous reply (a tool call of output_len tokens) and the tool's result
                call = '<tool_call>{"name": "run", "arguments": "' + words_text(rng, output_len, sizer) + '"}</tool_call>'
                history += [{"role": "assistant", "content": call},
                            {"role": "user", "content": "<tool_response>" + words_text(rng, suffix_len, sizer)
                             + "</tool_response>"}]
            requests.append(_request(list(history), output_len, sizer, after=last.get(c), conversation=c, turn=turn))
            last[c] = len(requests) - 1
    return requests


def file_requests(path: str, num: int, default_output_len: int, sizer, seed: int) -> list[BenchRequest]:
    """A JSONL file of {"prompt": ..., "max_tokens": ...} lines, or ShareGPT (a JSON list, or JSONL, of
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}): the first
    human turn is the prompt, the first gpt turn's length the output length (as vLLM's sharegpt)."""
    file = Path(path)
    if not file.is_file():
        raise LuceboxError(f"--dataset {path}: no such file (use random, agent, or a .jsonl / .json file)")
    text = file.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise LuceboxError(f"--dataset {path}: not JSON lines or a JSON list ({e})") from None
    requests = []
    for i, row in enumerate(rows, 1):
        request = _file_row(row, default_output_len, sizer)
        if request is None:
            raise LuceboxError(f"--dataset {path}: entry {i} has neither a string \"prompt\" nor ShareGPT "
                               "\"conversations\" with a human turn")
        requests.append(request)
    if not requests:
        raise LuceboxError(f"--dataset {path}: no prompts in the file")
    if num > len(requests):  # fewer prompts than asked for: repeat the file
        return [requests[i % len(requests)] for i in range(num)]
    return random.Random(seed).sample(requests, num)


def _file_row(row, default_output_len: int, sizer) -> BenchRequest | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str):
        output_len = row.get("max_tokens", row.get("output_len", default_output_len))
        return _request([{"role": "user", "content": row["prompt"]}], int(output_len), sizer)
    turns = row.get("conversations")
    if not isinstance(turns, list):
        return None
    human = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
    if not isinstance(human, str):
        return None
    reply = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "gpt"), None)
    output_len = sizer.count(reply) if isinstance(reply, str) and reply else default_output_len
    return _request([{"role": "user", "content": human}], output_len, sizer)
