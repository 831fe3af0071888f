"""What LLMEngine.from_args does before the engine itself is built: name the bundled default pair when
no model is given, and load the model unless the caller shares one it loaded already."""
from __future__ import annotations

from dataclasses import replace

from ..config import EngineArgs
from ..model.loader import LoadedModel, load_model


def resolve_args(args: EngineArgs, loaded: LoadedModel | None = None) -> EngineArgs:
    """A copy of args naming its model. No model: the loaded one's source when one is given, else the
    bundled default model, speculating as default_speculative_config() says unless
    args.speculative_config was given (an empty one, {}, turns speculation off)."""
    if args.model is not None:
        return args
    if loaded is not None:
        return replace(args, model=loaded.source)
    from ..default_model import default_model_path, default_speculative_config
    spec = args.speculative_config if args.speculative_config is not None else default_speculative_config()
    return replace(args, model=str(default_model_path()), speculative_config=spec)


def args_and_model(args: EngineArgs, loaded: LoadedModel | None = None) -> tuple[EngineArgs, LoadedModel]:
    """(args naming their model, the loaded model): `loaded` itself when given."""
    args = resolve_args(args, loaded)
    if loaded is None:
        if args.device_map is not None:  # loaded on the host, then each part moved to its device
            from .placement import load_dtype
            loaded = load_model(args.model, dtype=load_dtype(args), device="cpu")
        else:
            loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.device_map is not None:
        from .placement import place
        place(loaded, args)
    return args, loaded


def summary(engine) -> str:
    """The line the CLI and the server print once an engine is built: model, KV capacity and types, context."""
    k, v = engine.runner.cache_types
    placement = getattr(engine.model, "placement", None)  # --device-map: where each layer went, each device's memory
    where = "".join(f"\n  {line}" for line in placement.describe(engine.model)) if placement is not None else ""
    pool = engine.kv_pool
    pooled = (f"; KVFlash: {pool.pool_tokens:,} resident tokens a pooled sequence, host memory for "
              f"{pool.host_capacity_tokens:,}" if pool is not None else "")
    return (f"[{engine.loaded.source}: KV cache holds {engine.kv_capacity_tokens:,} tokens (K {k}, V {v}); "
            f"context {engine.max_model_len:,}{pooled}]{where}")
