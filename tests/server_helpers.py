"""Server test fixtures: a tiny Qwen3 model whose tokenizer knows <think> / <tool_call>, a Qwen-style
chat template with tools, a real uvicorn server on a free port (in a thread with its own loop), and
a test-only hook that forces the model's output (a random model cannot be trusted to call tools)."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import torch
import uvicorn

from lucebox import LLM
from lucebox.engine.async_engine import AsyncEngine
from lucebox.server.app import ServerConfig, create_app

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a function as <tool_call>\\n{\"name\": <function-name>, \"arguments\": <args>}\\n"
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
CORPUS = ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} The weather in Paris is '
          'sunny, 21 degrees. def add(a, b): return a + b  # tool_response system user assistant\n') * 20


def build_model(root: Path) -> Path:
    """A HF directory: trained BPE tokenizer with the tag specials + random tiny Qwen3 weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.conftest import build_hf_model

    tok_dir = root / "tok"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": TOOL_TEMPLATE}))
    return build_hf_model("qwen3", root / "model", tok_dir, max_position_embeddings=2048)


class ForceText:
    """Test-only logits processor: the output is exactly `text` (then EOS); optionally slow to start."""

    def __init__(self, tokenizer, text: str, eos: int, first_delay: float = 0.0):
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
        self.first_delay = first_delay

    def __call__(self, history, logits):
        i = len(history)
        if i == 0 and self.first_delay:
            time.sleep(self.first_delay)
        out = torch.full_like(logits, float("-inf"))
        out[self.ids[min(i, len(self.ids) - 1)]] = 0.0
        return out


class Forcing:
    """request_processors hook: a request whose model is "force:<key>" gets SCRIPTS[key] as output."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos, self.scripts = tokenizer, eos, {}

    def __call__(self, api: str, body: dict):
        model = body.get("model") or ""
        if not model.startswith("force:"):
            return []
        key = model[len("force:"):]
        if key == "slow":
            return [ForceText(self.tokenizer, "ok", self.eos, first_delay=1.0)]
        return [ForceText(self.tokenizer, self.scripts[key], self.eos)]


class ServerThread:
    """uvicorn on 127.0.0.1:<free port>, in a thread with its own event loop."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(model_dir: Path, config: ServerConfig | None = None, **engine_kwargs):
    llm = LLM(str(model_dir), **engine_kwargs)
    engine = AsyncEngine(llm.engine)
    forcing = Forcing(llm.tokenizer, llm.tokenizer.eos_token_id)
    app = create_app(engine, config or ServerConfig(keepalive=0.3), model_id="tiny", request_processors=forcing)
    return ServerThread(app).start(), llm, forcing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, proc, seconds: float, output=lambda: "") -> None:
    """Poll url/health until it answers 200; fail with `output()` (the server's log) if the process
    exits or `seconds` pass first."""
    import httpx
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, output()
        time.sleep(0.2)


def assert_tool_choice_holds_the_format(client, weather: dict) -> None:
    """tool_choice "required" (one call of either tool, greedy) and a named tool (sampled) each give a
    parseable call with typed arguments, through the OpenAI SDK `client`: the model is untrained, so only
    the server's constrained decoding can produce them. `weather` is the family's get_weather tool."""
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "exact": {"type": "boolean"}},
              "required": ["unit", "exact"]}
    temp = {"type": "function", "function": {"name": "temp", "parameters": schema}}
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[temp, weather], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("temp", "get_weather") and isinstance(json.loads(call.function.arguments), dict)
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[temp, weather], max_tokens=120,
                                       temperature=0.8, seed=3,
                                       tool_choice={"type": "function", "function": {"name": "temp"}})
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "temp" and args["unit"] in ("c", "f") and isinstance(args["exact"], bool)
