"""The benchmarks' and tests' held-out code: snippets of Python standard-library modules that the
default model's corpus rule holds out (lucebox/train/corpus.py: one file in 50 by content hash),
so the bundled model and drafter never trained on them, on any machine or Python version. Test
packages and the `encodings` tables are left out (data, not code)."""
from __future__ import annotations

import random
import sysconfig
from functools import lru_cache
from pathlib import Path

from ..train.corpus import is_held_out, usable

LEFT_OUT = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings"}


@lru_cache(maxsize=1)
def held_out_sources() -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if LEFT_OUT & set(path.relative_to(root).parts):
            continue
        data = path.read_bytes()
        text = usable(data)
        if text is not None and is_held_out(data):
            texts.append(text)
    if not texts:
        raise RuntimeError(f"no held-out Python source under {root}")
    return tuple(texts)


def held_out_texts(count: int, chars: int, seed: int = 0) -> list[str]:
    """`count` random windows of `chars` characters from the held-out sources (seeded), every
    character equally likely to start one: a short module is not sampled as often as a long one."""
    sources = [t for t in held_out_sources() if len(t) > chars]
    if not sources:
        raise ValueError(f"no held-out source is longer than {chars} characters")
    rng = random.Random(seed)
    texts = []
    weights = [len(t) - chars for t in sources]
    for _ in range(count):
        text = rng.choices(sources, weights)[0]
        start = rng.randrange(len(text) - chars)
        texts.append(text[start:start + chars])
    return texts
