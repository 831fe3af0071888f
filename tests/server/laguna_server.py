"""The Laguna server the Laguna chat tests share (test_laguna_chat.py, test_laguna_constrained.py): a
tokenizer built like Laguna's (`〈|EOS|〉` BOS and EOS, `</assistant>` an ordinary added token the config
lists among the EOS ids), a tiny random Laguna model, XS.2's chat template, scripted outputs by model name
(`force:NAME`), and the output parser of the arg_key call format."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from lucebox import LLM
from lucebox.engine.async_engine import AsyncEngine
from lucebox.server.app import create_app
from lucebox.server.config import ServerConfig
from lucebox.server.parsing import OutputParser, ParsedOutput
from tests.conftest import build_hf_model
from tests.model.test_laguna import LAGUNA
from tests.server_helpers import CORPUS, ForceText, Forcing, ServerThread

FIXTURES = Path(__file__).parents[1] / "fixtures"
TEMPLATE = (FIXTURES / "laguna_xs2_chat_template.jinja").read_text()
TIGHT_TEMPLATE = (FIXTURES / "laguna_s21_chat_template.jinja").read_text()  # Laguna S 2.1
EOS, TURN_END = "〈|EOS|〉", "</assistant>"
SPECIALS = [EOS, "<system>", "</system>", "<user>", "</user>", "<assistant>", "<think>", "</think>", "<tool_call>",
            "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>",
            "</tool_response>"]
REASONING, ANSWER = "The user greets me; answer briefly.", "Hello! How can I help?"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"type": "string"}},
                   "required": ["city"]}}}
BASH = {"type": "function", "function": {
    "name": "Bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"},
                                                    "env": {"type": "object"}}, "required": ["command"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in (WEATHER, BASH)}
THOUGHT = "I need the weather."
# Calls as the template writes them (and so as the model learned them): strings raw, the rest JSON.
CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
TWO_CALLS = [("get_weather", {"city": "Rome, Italy", "days": 2, "units": "metric"}),
             ("Bash", {"command": 'echo "<b>hi</b>" > /tmp/x', "env": {"DEBUG": 1, "PATH": "/bin"}, "timeout": 1.5})]
REPLY_TWO_CALLS = ("\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome, Italy</arg_value>\n"
                   "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>units</arg_key>\n"
                   "<arg_value>metric</arg_value>\n</tool_call>\n<tool_call>Bash\n<arg_key>command</arg_key>\n"
                   '<arg_value>echo "<b>hi</b>" > /tmp/x</arg_value>\n<arg_key>env</arg_key>\n'
                   '<arg_value>{"DEBUG": 1, "PATH": "/bin"}</arg_value>\n<arg_key>timeout</arg_key>\n'
                   "<arg_value>1.5</arg_value>\n</tool_call>\n" + TURN_END)
# What the model writes after the prompt's generation prompt (`<assistant>\n</think>` or `...<think>`).
SCRIPTS = {
    "hello": f"\n{ANSWER}\n{TURN_END}\n<user>\nthe model went on",
    "hello-thinking": f"\n{REASONING}\n</think>\n{ANSWER}\n{TURN_END}",
    "call": f"\n{THOUGHT}\n</think>\n{CALL}\n{TURN_END}",
    "two-calls": REPLY_TWO_CALLS,
    "answer": f"\nThe tool answered.\n</think>\nIt is sunny in Paris.\n{TURN_END}",
}


def parse(text: str, sizes=None, **kwargs) -> ParsedOutput:
    parser, events, i = OutputParser(call_format="glm", **kwargs), [], 0
    while i < len(text):
        k = sizes() if sizes else len(text)
        events += parser.feed(text[i:i + k])
        i += k
    return ParsedOutput.of(events + parser.finish())


def build_laguna_tokenizer(tok_dir: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = CORPUS + f"{REPLY_TWO_CALLS} {REASONING} {ANSWER} {THOUGHT} {TEMPLATE}" * 5
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(TURN_END, special=False, normalized=False)])
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
        "chat_template": TEMPLATE}))
    return tok_dir


class ScriptedIds(Forcing):
    """Forcing, plus outputs given as token ids (a turn end spelled out in several tokens)."""

    def __init__(self, tokenizer, eos: int):
        super().__init__(tokenizer, eos)
        self.ids: dict[str, list[int]] = {}

    def __call__(self, api: str, body: dict):
        key = (body.get("model") or "").removeprefix("force:")
        if key not in self.ids:
            return super().__call__(api, body)
        forced = ForceText(self.tokenizer, "", self.eos)
        forced.ids = self.ids[key] + [self.eos]
        return [forced]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("laguna-chat")
    tok_dir = build_laguna_tokenizer(root / "tok")
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    end_id = len(vocab)  # the added </assistant>
    model_dir = build_hf_model("qwen3", root / "laguna", tok_dir, **dict(
        LAGUNA, model_type="laguna", max_position_embeddings=4096, bos_token_id=vocab[EOS],
        eos_token_id=[vocab[EOS], end_id]))
    llm = LLM(str(model_dir), block_size=16, max_num_seqs=4)
    assert llm.tokenizer.token_to_id(TURN_END) == end_id
    forcing = ScriptedIds(llm.tokenizer, llm.tokenizer.eos_token_id)
    forcing.scripts.update(SCRIPTS)
    encode = llm.tokenizer.encode
    forcing.ids["spelled"] = [i for piece in (f"\n{ANSWER}\n", "</assist", "ant>", "\n<user>\nmore")
                              for i in encode(piece, add_special_tokens=False)]
    app = create_app(AsyncEngine(llm.engine), ServerConfig(keepalive=0.3), model_id="tiny", request_processors=forcing)
    srv = ServerThread(app).start()
    srv.llm = llm
    yield srv
    srv.stop()


def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
