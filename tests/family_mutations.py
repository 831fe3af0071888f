"""One GGUF family's mutated files (tests/hybrid_mutations.py, tests/gemma4_mutations.py): the shared
writer, metadata / tensor edit cases and byte flips, in the house style of tests/mutations.py."""
from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from tests.mutations import Case, parse_gguf


class ArchFiles:
    """A GGUF family's mutation cases (tests/hybrid_mutations.py, gemma4_mutations.py): its valid file
    (metadata() and tensors() of the family, stacked experts `*_exps.weight` in Q8_0, the rest F32),
    metadata / tensor edits of it, and random byte flips."""

    def __init__(self, arch: str, metadata: Callable[[], dict], tensors: Callable[[], dict], prefix: str):
        self.arch, self.metadata, self.tensors, self.prefix = arch, metadata, tensors, prefix
        self._valid: bytes | None = None

    def write(self, path: Path, meta=None, values=None) -> Path:
        w = GGUFWriter(str(path), self.arch)
        for key, (value, vtype, sub) in (meta or self.metadata()).items():
            w.add_key_value(key, value, vtype, sub_type=sub)
        for name, array in (values or self.tensors()).items():
            if name.endswith("_exps.weight"):
                w.add_tensor(name, quantize(array, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(name, array)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    def meta_case(self, case_id: str, key: str, value, expected: str, vtype=GGUFValueType.UINT32, sub=None) -> Case:
        """`{arch}.{key}` set to value (None: removed)."""
        def build(directory: Path) -> Path:
            meta = self.metadata()
            if value is None:
                del meta[f"{self.arch}.{key}"]
            else:
                meta[f"{self.arch}.{key}"] = (value, vtype, sub)
            return self.write(directory / f"{case_id}.gguf", meta)
        return Case(case_id, build, expected)

    def tensor_case(self, case_id: str, edit, expected: str) -> Case:
        """The tensors dict edited in place by `edit`."""
        def build(directory: Path) -> Path:
            values = self.tensors()
            edit(values)
            return self.write(directory / f"{case_id}.gguf", values=values)
        return Case(case_id, build, expected)

    def valid_bytes(self) -> bytes:
        if self._valid is None:
            with tempfile.TemporaryDirectory() as directory:
                self._valid = self.write(Path(directory) / "valid.gguf").read_bytes()
        return self._valid

    def flip_cases(self, count: int, seed: int) -> list[Case]:
        """Random byte flips, mostly in the header: a clean load or a LuceboxError, nothing else."""
        rng = random.Random(seed)
        cases = []
        for i in range(count):
            flips = [(rng.random(), rng.randrange(256)) for _ in range(rng.choice((1, 1, 2, 4)))]
            in_header = rng.random() < 0.85
            case_id = f"{self.prefix}_flip_{i:03d}"

            def build(directory: Path, flips=flips, in_header=in_header, case_id=case_id) -> Path:
                data = bytearray(self.valid_bytes())
                span = parse_gguf(bytes(data)).header_end if in_header else len(data)
                for where, value in flips:
                    data[int(where * span)] = value
                out = directory / f"{case_id}.gguf"
                out.write_bytes(bytes(data))
                return out
            cases.append(Case(case_id, build, None))
        return cases
