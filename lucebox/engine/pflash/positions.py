"""A compressed prompt's positions: the kept tokens lie contiguously in the KV cache (storage
positions 0..kept-1) but are rotated at their original positions; what follows the prompt (output,
drafts) is rotated `original_len - kept` past its storage position, so decoding continues at the
original prompt length."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptCompression:
    original_ids: list[int]  # the whole prompt, as the request sent it
    kept_positions: list[int]  # original position of each kept token, ascending

    def __post_init__(self):
        kept = self.kept_positions
        if not kept or any(b <= a for a, b in zip(kept, kept[1:])) or kept[0] < 0 or kept[-1] >= len(self.original_ids):
            raise ValueError("kept positions must be ascending original positions of the prompt")

    @property
    def kept_ids(self) -> list[int]:
        return [self.original_ids[p] for p in self.kept_positions]

    @property
    def shift(self) -> int:
        """RoPE position minus storage position past the prompt."""
        return len(self.original_ids) - len(self.kept_positions)

    def shift_of(self, start: int) -> int | None:
        """The constant RoPE shift of a row stored from `start` on when the row lies wholly past the
        kept prompt (its positions are storage + shift, a graph bucket's PlanRow.rope_shift); None
        when some of it is prompt, whose positions follow the kept map (`positions`)."""
        return self.shift if start >= len(self.kept_positions) else None

    def positions(self, start: int, n: int, depths: list[int] | None = None) -> list[int]:
        """RoPE positions of the tokens stored at start..start+n-1; depths: a tree verify row's (token i
        rotated at the position of start + depths[i])."""
        offsets = depths if depths is not None else range(n)
        kept, shift = self.kept_positions, self.shift
        return [kept[p] if p < len(kept) else p + shift for p in (start + d for d in offsets)]
