"""Training: DFlash drafters for any supported target (`lucebox train-drafter`).

Imports are lazy so that `lucebox --help` does not pay for torch and the engine."""
from __future__ import annotations

_EXPORTS = {"train_drafter": "drafter", "TrainResult": "drafter", "EvalResult": "drafter",
            "TrainDrafterArgs": "args", "default_taps": "prepare"}
__all__ = ["EvalResult", "TrainDrafterArgs", "TrainResult", "default_taps", "train_drafter"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lucebox.train' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
