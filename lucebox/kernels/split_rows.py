"""Split rows: the layout Q8_0 and Q6_K weights take on the GPU (torch; triton_split_rows.py holds
their decode GEMVs).

ggml's blocks interleave each block's scales with its values: a Q8_0 block is 34 bytes (an fp16
scale, then 32 int8 values), a Q6_K super-block 210 bytes (128 bytes of low nibbles, 64 of 2-bit
high pairs, 16 int8 scales, an fp16 d), so their fields sit at 2-byte alignment and a kernel loads
them a byte or two at a time. A split row holds the same bytes per output feature, field by field:
every block's first field, then every block's second, ... (Q8_0: the K values, then the K/32
scales; Q6_K: all low nibbles | all high pairs | all scales | all d). Each field's run is then
16-byte aligned when the row is (Q8_0: K a multiple of 256; Q6_K: of 2048, 8 super-blocks, as the
8B shape's 4096 and 12288), and a program loads 16 values with one instruction.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

# ggml type -> (bytes per block, byte ranges of its fields in ggml's block, the field order in a split row)
_FIELDS = {
    Q.Q8_0: (34, ((2, 34), (0, 2))),  # values, scale
    Q.Q6_K: (210, ((0, 128), (128, 192), (192, 208), (208, 210))),  # ql, qh, scales, d
}
SPLIT_TYPES = frozenset(_FIELDS)
# Row lengths (values) that leave every field 16-byte aligned: what the GEMVs were timed on.
_ALIGNED_K = {Q.Q8_0: 256, Q.Q6_K: 2048}


def applies(qtype, row_length: int) -> bool:
    """Whether rows of this type and length take the split layout."""
    return qtype in _ALIGNED_K and row_length % _ALIGNED_K[qtype] == 0


def split_rows(raw: torch.Tensor, qtype) -> torch.Tensor:
    """ggml rows [N, bytes] -> split rows of the same size: each field's bytes for every block of
    the row, field after field."""
    block, fields = _FIELDS[qtype]
    n, row_bytes = raw.shape
    blocks = raw.view(n, row_bytes // block, block)
    return torch.cat([blocks[:, :, a:b].reshape(n, -1) for a, b in fields], dim=1)


def join_rows(split: torch.Tensor, qtype) -> torch.Tensor:
    """split_rows' inverse: ggml rows."""
    block, fields = _FIELDS[qtype]
    n, row_bytes = split.shape
    nb = row_bytes // block
    parts, start = [None] * len(fields), 0
    for a, b in fields:
        parts[sorted(fields).index((a, b))] = split[:, start:start + nb * (b - a)].reshape(n, nb, b - a)
        start += nb * (b - a)
    return torch.cat(parts, dim=2).reshape(n, row_bytes)
