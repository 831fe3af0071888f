"""The flags of `lucebox launch` and `lucebox qualify` (importable without torch, for --help)."""
from __future__ import annotations

import argparse

from .clients import CLIENTS

DEFAULT_CONTEXT = 65536


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model lucebox serves (default: the bundled default model)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_CONTEXT,
                   help="context window the server is started with (the clients' prompts need tens of K tokens)")


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("client", choices=list(CLIENTS), help="the program to run")
    _server_flags(p)
    p.add_argument("--url", default=None, help="use the lucebox server at this URL instead of starting one")
    p.add_argument("--api-key", default=None, help="the key of the --url server (default: a fresh random key "
                                                   "for the server launch starts)")
    p.add_argument("--install", action="store_true", help="install the client first when it is not on PATH")
    p.add_argument("--max-output", type=int, default=4096, help="output tokens the client may ask for per turn")
    p.set_defaults(client_args=[])  # what follows `--` (split off by split_client_args)
    p.epilog = "arguments after -- go to the client: lucebox launch codex -- exec 'fix the tests'"


def add_qualify_arguments(p: argparse.ArgumentParser) -> None:
    from .qualify import RECIPES
    p.add_argument("clients", nargs="+", choices=list(RECIPES), metavar="CLIENT",
                   help=f"clients to qualify: {', '.join(RECIPES)}")
    _server_flags(p)
    p.add_argument("--out", default=None, help="directory for transcripts (default: ./qualify-<time>)")
    p.add_argument("--short", action="store_true", help="CI's short form: the tool round trip with streaming and "
                                                        "reasoning only (no long prompt, no interruption)")
    p.add_argument("--install", action="store_true", help="install missing clients first")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each client session may take")


def split_client_args(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`lucebox [-v] launch CLIENT [flags] -- ARGS`: (the argv for lucebox's parser, ARGS or None)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command != "launch" or "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def run_launch(args) -> int:
    from .launch import launch
    return launch(args.client, args.client_args, model=args.model, url=args.url, max_model_len=args.max_model_len,
                  api_key=args.api_key, install=args.install, max_output=args.max_output)


def run_qualify(args) -> int:
    from .qualify import main
    return main(args)
