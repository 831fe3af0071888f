"""Tokenizer test data and files: texts, the real models' pre-tokenizer regexes and chat templates, trained
byte-level BPE tokenizers, HF directories and GGUF vocabularies written from them, a SentencePiece reference."""

import json

import gguf
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

# ---- test data -------------------------------------------------------------------------------------

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine; we've seen worse, haven't we?",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 1024; ++i) { total += values[i] * 3.14159; }  // sum it up\n",
    'import json\nprint(json.dumps({"name": "lucebox", "version": [0, 1, 2]}, indent=2))\n',
    "Numbers: 1234567890, 2024-06-01, 0x7fff, 1e-9, 42%, $19.99 and 3,000,000 people.",
    "Unicode text: naïve café, résumé, Ελληνικά, русский язык, 東京タワーは高い。中文分词测试，日本語もある。",
    "Emoji: 🤖🧠👍 ok 🎉🎉 and a ZWJ sequence 👩‍💻 plus flags 🇫🇷.",
    "Whitespace   runs\t\ttabs\n\n\nnew lines    and trailing spaces   \n",
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHi! How can I help?<|im_end|>\n",
]
CORPUS = [p for _ in range(6) for p in PARAGRAPHS]

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n",
    "Unicode: naïve café, 東京タワー, Ελληνικά, emoji 🤖🧠👍🏽 and ZWJ 👩‍💻 and unseen 🦜 𝔘",
    "digits 1234567890 3.14159 1e-9 0x7fff 00000",
    "   leading spaces\t\ttabs\n\n\n  trailing   ",
    '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>{"a": 1}</tool_call><|im_end|>',
    "I'm sure they'll say it's OK, WE'LL SEE, You'RE right",
    "e\u0301 combining accent (NFD) vs é (NFC)",
    "",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]

# The pre-tokenizer regexes of the real models' tokenizer.json files, written out independently of lucebox.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role in ['ipython', 'tool'] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
    {%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MESSAGES = [
    {"role": "system", "content": "You are terse. Ünïcödé is fine."},
    {"role": "user", "content": "What's the weather in 東京? 🌧 <b>&</b>"},
    {
        "role": "assistant",
        "content": None,  # as OpenAI clients send it; transformers drops None-valued keys
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}],
    },
    {"role": "tool", "content": '{"temperature": 21, "unit": "°C"}'},
    {"role": "assistant", "content": "It is 21 °C in 東京."},
    {"role": "user", "content": "Thanks!"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city, in °C <now>",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. 東京"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]


# ---- helpers ---------------------------------------------------------------------------------------


def train_byte_level_bpe(pre: str = "gpt-2", vocab_size: int = 800) -> tokenizers.Tokenizer:
    """A tiny tokenizer shaped like GPT-2 ("gpt-2"), Llama 3 ("llama-bpe") or Qwen2 ("qwen2")."""
    tok = tokenizers.Tokenizer(models.BPE())
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        regex = LLAMA3_REGEX if pre == "llama-bpe" else QWEN2_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if pre == "llama-bpe":
        tok.model.ignore_merges = True  # as in Llama 3's tokenizer.json
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # added, but not special (Qwen has these)
    return tok


def added_token_json(content: str) -> dict:
    """A special token as older tokenizer_config.json files store it (a serialised AddedToken)."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def write_hf_dir(path, tok: tokenizers.Tokenizer, **config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return str(path)


def write_gguf(path, model: str, tokens, types, *, merges=None, scores=None, pre=None, **keys) -> gguf.GGUFReader:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for name, value in keys.items():  # add_bos_token_id=..., add_chat_template=..., ...
        getattr(w, name)(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def gguf_from_hf(path, tok: tokenizers.Tokenizer, pre: str, **keys) -> gguf.GGUFReader:
    """What llama.cpp's convert_hf_to_gguf writes for a byte-level BPE tokenizer."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    added = tok.get_added_tokens_decoder()
    types = [
        (gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED) if i in added
        else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return write_gguf(path, "gpt2", tokens, types, merges=merges, pre=pre, **keys)


def spm_reference_encode(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece algorithm, naively: join the adjacent pair making the best-scored piece."""
    symbols = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            j = vocab.get(symbols[i] + symbols[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):  # strict: leftmost wins ties
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    ids = []
    for s in symbols:
        ids.extend([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
    return ids


def hand_spm_vocab():
    """A small SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte pieces, ▁-prefixed pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = ["ll", "he", "\u2581he", "llo", "\u2581hello", "or", "\u2581w", "ld", "\u2581wor", "\u2581world",
              "\u2581hell", "lo", "\u2581a", "aa", "\u2581aa"]
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank))
    for ch in "\u2581helowrdab!,.":  # single characters score lowest, as in sentencepiece
        tokens.append(ch)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0)
    return tokens, types, scores
