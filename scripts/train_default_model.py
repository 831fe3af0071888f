"""Train lucebox's bundled default target model (a small Qwen3-architecture code model).

Run on one GPU (the H200 machine: about 8 minutes). Steps: corpus of installed Python packages
(deduplicated, held-out split by file) -> byte-level BPE tokenizer with ChatML, reasoning and
tool-call specials and a DFlash mask token -> pre-training on code -> a short chat stage
(signature + docstring -> the function) -> held-out loss and sample completions -> a HF
directory (safetensors shards small enough to copy back, tokenizer, chat template,
generation_config) and stats.json for the model card. The drafter is trained afterwards with
`lucebox train-drafter` (scripts/train_default_drafter.sh).

    python scripts/train_default_model.py --out DIR [--corpus-mb 150] [--pretrain-seconds 330]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lucebox.text.gguf_vocab import QWEN2_REGEX  # noqa: E402
from lucebox.model.config import ModelConfig  # noqa: E402
from lucebox.model.transformer import Transformer  # noqa: E402
from lucebox.train import corpus  # noqa: E402
from lucebox.train.lm import evaluate, train  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<|mask|>"]
CHAT_TEMPLATE = open(Path(__file__).with_name("chat_template.jinja")).read()
ARCH = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=384, intermediate_size=1024,
            num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
            hidden_act="silu", attention_bias=False, torch_dtype="bfloat16")


def log(msg: str) -> None:
    print(msg, flush=True)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode(tok, texts: list[str]) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for i in range(0, len(texts), 2000):
        for enc in tok.encode_batch(texts[i:i + 2000]):
            out.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
    return np.concatenate(out)


def windows(tokens: np.ndarray, length: int, batch: int, device, seed: int):
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(tokens.astype(np.int64))
    while True:
        starts = rng.integers(0, len(tokens) - length - 1, size=batch)
        yield torch.stack([data[s:s + length + 1] for s in starts]).to(device, non_blocking=True)


def chat_batches(tok, tasks, pretrain_tokens, device, batch: int, length: int, seed: int):
    """Chat examples (loss on the assistant's answer only), mixed with pre-training windows so the
    model keeps its code completion."""
    rng = random.Random(seed)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    nl = tok.encode("\n").ids
    pad = tok.token_to_id("<|endoftext|>")
    encoded = []
    for prompt, answer in tasks:
        head = [start] + tok.encode("user\n" + prompt).ids + [end] + nl + [start] + tok.encode("assistant\n").ids
        body = tok.encode(answer).ids + [end] + nl
        if len(head) + len(body) <= length + 1:
            encoded.append((head, body))
    if not encoded:
        raise ValueError(f"none of the {len(tasks)} chat tasks fits in {length} tokens")
    plain = windows(pretrain_tokens, length, batch // 4, device, seed)
    while True:
        ids = torch.full((batch - batch // 4, length + 1), pad, dtype=torch.long)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for row in range(ids.shape[0]):
            head, body = rng.choice(encoded)
            seq = head + body
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, len(head):len(seq)] = True
        extra = next(plain)
        yield torch.cat([ids.to(device), extra]), torch.cat([mask.to(device), torch.ones_like(extra, dtype=torch.bool)])


def save_sharded(model: Transformer, out: Path, max_shard_bytes: int = 12 << 20) -> None:
    from safetensors.torch import save_file
    state = {("model." + k if not k.startswith("lm_head") else k): v.detach().to(torch.bfloat16).contiguous().cpu()
             for k, v in model.state_dict().items()}
    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


@torch.no_grad()
def samples(out: Path, prompts: list[str], **engine_args) -> list[dict]:
    from lucebox import LLM, SamplingParams
    llm = LLM(str(out), dtype="float32", **engine_args)
    greedy = SamplingParams(temperature=0, max_tokens=96)
    results = []
    for prompt in prompts:
        text = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
        results.append({"prompt": prompt, "completion": text})
    chat = llm.chat([{"role": "user", "content": "Complete this Python function:\n```python\n"
                      "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n```"}],
                    greedy, use_tqdm=False)[0].outputs[0].text
    results.append({"prompt": "(chat) Complete this Python function: def is_palindrome(s: str) -> bool ...",
                    "completion": chat})
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus-mb", type=int, default=150)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--pretrain-seconds", type=float, default=330)
    ap.add_argument("--chat-seconds", type=float, default=50)
    ap.add_argument("--deadline-seconds", type=float, default=560,
                    help="finish everything within this time (the GPU machine runs one command for 10 minutes)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stats = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "args": vars(args)}
    t0 = time.time()
    train_texts, held_texts, stats["corpus"] = corpus.collect(args.corpus_mb << 20)
    log(f"corpus {stats['corpus']} in {time.time() - t0:.0f}s")
    rng = random.Random(args.seed)
    tok = train_tokenizer(rng.sample(train_texts, min(len(train_texts), 3000)), args.vocab)
    tok.save(str(out / "tokenizer.json"))
    log(f"tokenizer {tok.get_vocab_size()} tokens at {time.time() - t0:.0f}s")
    train_tokens, held_tokens = encode(tok, train_texts), encode(tok, held_texts)
    stats["tokens"] = {"train": int(len(train_tokens)), "held_out": int(len(held_tokens))}
    log(f"encoded {stats['tokens']} at {time.time() - t0:.0f}s")

    eos = tok.token_to_id("<|im_end|>")
    config = dict(ARCH, vocab_size=tok.get_vocab_size(), eos_token_id=eos, bos_token_id=None)
    model = Transformer(ModelConfig.from_hf_dict(config)).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    stats["parameters"] = sum(p.numel() for p in model.parameters())
    held_windows = windows(held_tokens, args.seq_len, 8, "cpu", 1)
    held = [next(held_windows) for _ in range(16)]
    # Leave time for the chat stage, evaluation, saving and samples (about 90 s) inside the deadline.
    budget = min(args.pretrain_seconds, args.deadline_seconds - (time.time() - t0) - args.chat_seconds - 90)
    log(f"pre-training for {budget:.0f}s")
    stats["pretrain"] = train(model, lambda: windows(train_tokens, args.seq_len, args.batch, device, args.seed),
                              budget, args.lr, log=log)
    stats["held_out_loss_after_pretrain"] = evaluate(model, held, device)
    log(f"held-out loss {stats['held_out_loss_after_pretrain']:.3f}")
    tasks = corpus.function_tasks(train_texts, 40000)
    stats["chat_tasks"] = len(tasks)
    stats["chat"] = train(model, lambda: chat_batches(tok, tasks, train_tokens, device, 64, 512, args.seed),
                          args.chat_seconds, args.lr * 0.3, warmup=0.05, log=log)
    stats["held_out_loss"] = evaluate(model, held, device)
    log(f"held-out loss after chat stage {stats['held_out_loss']:.3f}")

    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": ARCH["max_position_embeddings"],
        "additional_special_tokens": SPECIALS}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [eos, tok.token_to_id("<|endoftext|>")], "do_sample": True, "temperature": 0.2,
        "top_p": 0.95}, indent=2))
    save_sharded(model, out)
    stats["samples"] = samples(out, ["def fibonacci(n):\n", "import os\n\n\ndef list_python_files(root):\n",
                                     "class Stack:\n    def __init__(self):\n"])
    stats["seconds"] = time.time() - t0
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    log(json.dumps(stats["samples"], indent=1)[:3000])
    log(f"done in {stats['seconds']:.0f}s; held-out loss {stats['held_out_loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
