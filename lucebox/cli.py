"""lucebox command line: serve | generate | chat | convert | bench (train-drafter joins later)."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace

from .config import EngineArgs, SpeculativeConfig
from .errors import LuceboxError

SAMPLING_FLAGS = {  # flag -> (type, help); unset flags take the model's generation_config defaults
    "temperature": (float, "sampling temperature; 0 = greedy (default: the model's generation_config)"),
    "top_p": (float, "nucleus sampling mass (default: the model's)"),
    "top_k": (int, "keep the k most likely tokens; 0 = off (default: the model's)"),
    "min_p": (float, "drop tokens below min_p x the top probability (default: the model's)"),
    "repetition_penalty": (float, "penalty on tokens already in prompt or output (default: the model's)"),
    "presence_penalty": (float, "OpenAI-style presence penalty (default 0)"),
    "frequency_penalty": (float, "OpenAI-style frequency penalty (default 0)"),
    "seed": (int, "per-request sampling seed, for reproducible samples (default: none)"),
}


def _engine_flags(p: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    types = {"model": str, "dtype": str, "device": str, "max_model_len": int, "block_size": int,
             "max_num_seqs": int, "max_num_batched_tokens": int, "max_queue": int, "kv_cache_memory": int,
             "gpu_memory_utilization": float, "cache_type_k": str, "cache_type_v": str, "cuda_graph_max_batch": int,
             "recurrent_prefix_snapshots": int, "device_map": str, "draft_device": str,
             "tensor_parallel_size": int, "prefill_keep_ratio": float, "prefill_min_tokens": int,
             "prefill_scorer": str, "prefill_scorer_window": int, "kv_pool_tokens": int, "kv_reselect_interval": int,
             "kv_pool_host_memory": int,
             "draft_kv_pool_tokens": int}
    for name, kind in types.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name),
                       help=EngineArgs.HELP[name])
    p.add_argument("--cache-rotate-k", action="store_true", help=EngineArgs.HELP["cache_rotate_k"])
    p.add_argument("--kv-pool-target", action="store_true", help=EngineArgs.HELP["kv_pool_target"])
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=EngineArgs.prefill_graphs,
                   help=EngineArgs.HELP["prefill_graphs"])
    p.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=EngineArgs.async_decode,
                   help=EngineArgs.HELP["async_decode"])
    p.add_argument("--enforce-eager", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help=EngineArgs.HELP["enforce_eager"])
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off " + EngineArgs.HELP["enable_prefix_caching"])
    p.add_argument("--draft", default=None, help="drafter for speculative decoding: a DFlash drafter directory "
                                                 "(z-lab layout) or a smaller model with the same tokenizer")
    p.add_argument("--spec-method", default=None, choices=["dflash", "draft_model", "ngram"],
                   help="speculative method (default: dflash with --draft, none without; ngram needs no --draft)")
    p.add_argument("--spec-tokens", type=int, default=None,
                   help="draft tokens per step (default: block size - 1 for dflash, 4 draft_model, 5 ngram)")
    p.add_argument("--spec-ngram-first", action="store_true",
                   help="with --draft: n-gram prompt lookup drafts where the text repeats, the drafter elsewhere")
    p.add_argument("--spec-tree-budget", type=int, default=None,
                   help="dflash: verify a draft tree of this many nodes (DDTree, 1..63) built from each drafter "
                        "pass instead of a chain (dense targets; without --draft: the default model's drafter)")
    p.add_argument("--no-spec", action="store_true",
                   help="plain decoding even for the default model (which otherwise speculates with its drafter)")
    p.add_argument("--no-spec-adaptive", dest="spec_adaptive", action="store_false",
                   help="always draft the full length instead of adapting it to measured acceptance and cost")


def _sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    for name, (kind, help_text) in SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def _serve_flags(p: argparse.ArgumentParser) -> None:
    from .server.config import ServerConfig  # no web dependencies: --help works without them
    d, h = ServerConfig(), ServerConfig.HELP
    p.add_argument("--host", default=d.host, help=h["host"])
    p.add_argument("--port", type=int, default=d.port, help=h["port"])
    p.add_argument("--api-key", default=d.api_key, help=h["api_key"])
    p.add_argument("--served-model-name", default=d.served_model_name, help=h["served_model_name"])
    p.add_argument("--cors-origin", dest="cors_origins", action="append", default=[], help=h["cors_origins"])
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help=h["max_body_bytes"])
    p.add_argument("--keepalive", type=float, default=d.keepalive, help=h["keepalive"])
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help=h["request_timeout"])
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout, help=h["idle_timeout"])
    p.add_argument("--graceful-timeout", type=float, default=d.graceful_timeout, help=h["graceful_timeout"])
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens, help=h["default_max_tokens"])
    p.add_argument("--allow-request-chat-template", action="store_true", help=h["allow_request_chat_template"])
    for name in ("max_n", "max_stop_sequences", "max_top_logprobs", "max_request_tokens", "max_pending_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=h[name])
    # -v after the command too (`lucebox serve -v`); SUPPRESS keeps `lucebox -v serve` working
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log engine details")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="lucebox", description="Speculative-inference engine for LLMs",
                                     formatter_class=fmt)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI (chat, completions, responses) and Anthropic (messages) "
                                         "compatible HTTP server", formatter_class=fmt)
    _engine_flags(serve)
    _serve_flags(serve)
    serve.add_argument("--script", default=None, help=argparse.SUPPRESS)  # test only: lucebox/agents/script.py

    from .agents.cli import add_launch_arguments, add_qualify_arguments
    add_launch_arguments(sub.add_parser("launch", help="run a coding agent or chat app (Claude Code, Codex, "
                                        "OpenCode, ...) on lucebox serve", formatter_class=fmt))
    add_qualify_arguments(sub.add_parser("qualify", help="scripted sessions through real clients: a pass/fail "
                                         "table per client and check, with transcripts", formatter_class=fmt))

    gen = sub.add_parser("generate", help="generate a continuation and stream it", formatter_class=fmt)
    _engine_flags(gen)
    gen.add_argument("--prompt", default="def fibonacci(n):", help="the prompt text")
    gen.add_argument("--chat-template", action="store_true",
                     help="wrap the prompt as a user message with the model's chat template")
    _sampling_flags(gen, max_tokens=128)

    chat = sub.add_parser("chat", help="interactive chat that keeps the conversation", formatter_class=fmt)
    _engine_flags(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    _sampling_flags(chat, max_tokens=512)

    convert = sub.add_parser("convert", help="convert a HF model directory to a GGUF file", formatter_class=fmt)
    convert.add_argument("hf_dir", help="HF model directory (config.json, *.safetensors, tokenizer.json)")
    convert.add_argument("outfile", help="the .gguf file to write")
    convert.add_argument("--outtype", default="f16", help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0 or q5_1")

    from .train.args import add_arguments as train_drafter_arguments
    train = sub.add_parser("train-drafter", help="train a DFlash drafter for a target model", formatter_class=fmt)
    train_drafter_arguments(train)
    convert_drafter = sub.add_parser("convert-drafter", help="write a DFlash drafter directory as a GGUF file",
                                     formatter_class=fmt)
    convert_drafter.add_argument("drafter_dir", help="DFlash drafter directory (config.json + *.safetensors)")
    convert_drafter.add_argument("outfile", help="the .gguf file to write")
    convert_drafter.add_argument("--outtype", default="f16", help="f16 or q8_0 matrices (norms stay f32), or f32")

    bench = sub.add_parser("bench", help="benchmarks (bare `lucebox bench` runs `bench speed` with its defaults)",
                           formatter_class=fmt)
    bench_sub = bench.add_subparsers(dest="bench", required=False)
    from .bench.speed import add_arguments as speed_arguments
    speed_arguments(bench_sub.add_parser(
        "speed", formatter_class=fmt, help="batch-1 prefill / decode / verify speed against the GEMV bandwidth and "
                                           "matmul rate measured in the same run, a transformers peer; a markdown table"))
    from .bench.serve import add_arguments as serve_bench_arguments
    serve_bench_arguments(bench_sub.add_parser(
        "serve", formatter_class=fmt, help="load-test a server (--url, or --model started for the run): throughput, "
                                           "TTFT/TPOT/ITL percentiles, prefix-cache hits, acceptance (vLLM's names)"))
    from .bench.throughput import add_arguments as throughput_arguments
    throughput_arguments(bench_sub.add_parser(
        "throughput", formatter_class=fmt, help="batched decode tok/s against the batch's bandwidth limit (--shape "
                                                "/ --quant or --model), speculating too; KV bytes, prefix-cache hits"))
    from .bench.tp import add_arguments as tp_arguments
    tp_arguments(bench_sub.add_parser(
        "tp", formatter_class=fmt, help="tensor parallelism on a random --shape: TP=1 against TP=N in one run "
                                        "(TTFT, decode, verify of 16, collectives a step, scaling)"))
    sp = bench_sub.add_parser("spec", help="speculative decoding: tau, tok/s and speedup over plain decoding",
                              formatter_class=fmt)
    sp.add_argument("--model", default=None, help="target model (default: the default model)")
    sp.add_argument("--draft", default=None, help="drafter (DFlash dir or draft model); n-gram always runs")
    sp.add_argument("--spec-method", default="dflash", help="method of --draft: dflash or draft_model")
    sp.add_argument("--spec-tokens", type=int, default=None, help="draft tokens per step (default: the method's)")
    sp.add_argument("--no-adaptive", action="store_true", help="always draft the full length")
    sp.add_argument("--tree-budget", type=int, nargs="+", default=None,
                    help="also measure dflash draft trees (DDTree) of these node budgets against the chain")
    sp.add_argument("--async-decode", action=argparse.BooleanOptionalAction, default=EngineArgs.async_decode,
                    help=EngineArgs.HELP["async_decode"] + " (every engine of the run)")
    sp.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="sampling temperatures")
    sp.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    sp.add_argument("--chars", type=int, default=600, help="characters per prompt")
    sp.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    sp.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the median is reported")
    sp.add_argument("--dtype", default="auto", help=EngineArgs.HELP["dtype"])
    sp.add_argument("--device", default="auto", help=EngineArgs.HELP["device"])
    sp.add_argument("--json", default=None, help="also write the results to this JSON file")
    from .bench.prefill import add_arguments as prefill_arguments
    prefill_arguments(bench_sub.add_parser(
        "prefill", help="speculative prefill (PFlash): TTFT of exact vs scored prefill, scoring and target time"))
    from .bench.kv_pool import add_arguments as kv_pool_arguments
    kv_pool_arguments(bench_sub.add_parser(
        "kv-pool", help="KVFlash: decode tok/s and device KV memory at 8K-256K contexts, bounded pool vs full KV"))
    kq = bench_sub.add_parser("kv-quality", help="greedy agreement and perplexity of each KV cache type",
                              formatter_class=fmt)
    kq.add_argument("--model", default=None, help="model to measure (default: the default model)")
    kq.add_argument("--dtype", default="auto", help=EngineArgs.HELP["dtype"])
    kq.add_argument("--device", default="auto", help=EngineArgs.HELP["device"])
    kq.add_argument("--samples", type=int, default=16, help="held-out snippets")
    kq.add_argument("--chars", type=int, default=1200, help="characters per snippet")
    kq.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per snippet")
    return parser


def _sampling_params(args):
    from .sampling import SamplingParams
    chosen = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    return SamplingParams(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, **chosen)


def speculative_config(args) -> SpeculativeConfig | None:
    """--draft / --spec-* / --no-spec -> EngineArgs.speculative_config. None (no flag): the default model
    speculates with its drafter, any other model does not; --no-spec alone: off for every model."""
    method = args.spec_method or ("dflash" if args.draft else None)
    tree_budget = getattr(args, "spec_tree_budget", None)
    if method is None:
        if getattr(args, "no_spec", False):
            return SpeculativeConfig()
        if tree_budget is None:
            return None
        return _default_with_tree(args, tree_budget)
    return SpeculativeConfig(method=method, model=args.draft, num_speculative_tokens=args.spec_tokens,
                             adaptive=args.spec_adaptive, ngram_first=args.spec_ngram_first, tree_budget=tree_budget)


def _default_with_tree(args, tree_budget: int) -> SpeculativeConfig:
    """--spec-tree-budget without --draft: the default model's speculation, its drafter drafting trees."""
    from .default_model import default_speculative_config
    default = default_speculative_config() if getattr(args, "model", None) is None else None
    if default is None or default.method != "dflash":
        raise LuceboxError("--spec-tree-budget needs a DFlash drafter: pass --draft (the default model's bundled "
                           "drafter is used only without --model)")
    return replace(default, tree_budget=tree_budget)


def engine_args(args) -> EngineArgs:
    """The engine flags of `lucebox serve | generate | chat` as EngineArgs."""
    chosen = {k: getattr(args, k) for k in EngineArgs.field_names() if hasattr(args, k)}
    return EngineArgs(**dict(chosen, speculative_config=speculative_config(args)))


def _build_engine(args):
    from .engine.build import summary
    from .engine.engine import LLMEngine
    engine = LLMEngine.from_args(engine_args(args))
    print(summary(engine), file=sys.stderr)
    return engine


def _stream(engine, request_id: str, prompt, params, out=sys.stdout) -> tuple[str, int, float]:
    """Run one request to the end, printing text as it arrives. Returns (text, tokens, seconds)."""
    engine.add_request(request_id, prompt, params)
    start, shown, final = time.perf_counter(), 0, None
    while engine.has_unfinished():
        for output in engine.step():
            completion = output.outputs[0]
            out.write(completion.text[shown:])
            out.flush()
            shown = len(completion.text)
            final = completion
    return final.text, len(final.token_ids), time.perf_counter() - start


def cmd_serve(args) -> int:
    try:
        from .server.app import serve
    except ImportError as e:  # a trimmed install without the web stack
        raise LuceboxError(f"lucebox serve needs the server packages ({e.name} is missing): "
                           "pip install 'lucebox[server]'") from e
    from .server.config import ServerConfig
    logging.getLogger("lucebox.prefill").setLevel(logging.INFO)  # a long prompt's progress, -v or not
    config = ServerConfig(**{k: getattr(args, k) for k in ServerConfig.__dataclass_fields__ if hasattr(args, k)})
    processors_for = None
    if args.script:
        from .agents.script import Script, load_script
        load_script(args.script)  # a malformed script fails before the model loads
        processors_for = lambda engine: Script(args.script, engine.tokenizer)  # noqa: E731
    return serve(engine_args(args), config, verbose=args.verbose, processors_for=processors_for)


def cmd_generate(args) -> int:
    engine = _build_engine(args)
    try:
        return _generate(engine, args)
    finally:
        engine.shutdown()  # tensor-parallel ranks exit with the command


def _generate(engine, args) -> int:
    params = _sampling_params(args)
    prompt = args.prompt
    if args.chat_template:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
    else:
        sys.stdout.write(prompt)
    _, tokens, seconds = _stream(engine, "generate", prompt, params)
    print(f"\n[{tokens} tokens in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    engine = _build_engine(args)
    try:
        return _chat(engine, args)
    finally:
        engine.shutdown()


def _chat(engine, args) -> int:
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("lucebox chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(messages)
        prompt = {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
        turn += 1
        try:
            reply, tokens, seconds = _stream(engine, f"chat-{turn}", prompt, params)
        except LuceboxError as e:  # e.g. the conversation outgrew the context: say so, keep the session
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print(f"\n[{tokens} tokens, {tokens / max(seconds, 1e-9):.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})


def cmd_convert(args) -> int:
    from .convert import convert_hf_to_gguf
    path = convert_hf_to_gguf(args.hf_dir, args.outfile, args.outtype)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_train_drafter(args) -> int:
    from .train.drafter import main as train_drafter_main
    return train_drafter_main(args)


def cmd_convert_drafter(args) -> int:
    from .spec.dflash_gguf import convert_drafter_to_gguf
    path = convert_drafter_to_gguf(args.drafter_dir, args.outfile, args.outtype)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import kv_pool, kv_quality, prefill, serve, spec, speed, throughput, tp
    if args.bench == "serve":  # serve picks its own model: --url, --model or the default model
        return serve.main(args)
    if args.bench in (None, "speed"):  # speed picks its own model: --model, --shape or the default model
        return speed.main(args if args.bench else build_parser().parse_args(["bench", "speed"]))
    if args.bench in ("prefill", "kv-pool", "throughput", "tp"):  # as speed: --model or --shape (tp: --shape)
        return {"prefill": prefill, "kv-pool": kv_pool, "throughput": throughput, "tp": tp}[args.bench].main(args)
    if args.model is None:
        from .default_model import default_model_path
        args.model = str(default_model_path())
    return {"kv-quality": kv_quality, "spec": spec}[args.bench].main(args)


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "convert": cmd_convert, "bench": cmd_bench}
COMMANDS.update({"train-drafter": cmd_train_drafter, "convert-drafter": cmd_convert_drafter})


def cmd_launch(args) -> int:
    from .agents.cli import run_launch
    return run_launch(args)


def cmd_qualify(args) -> int:
    from .agents.cli import run_qualify
    return run_qualify(args)


COMMANDS.update({"launch": cmd_launch, "qualify": cmd_qualify})


def main(argv: list[str] | None = None) -> int:
    from .agents.cli import split_client_args
    argv, client_args = split_client_args(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if client_args is not None:
        args.client_args = client_args
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return COMMANDS[args.command](args)
    except LuceboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
