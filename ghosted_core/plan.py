"""What is removed: a pruning plan and its boundaries (maximal runs of removed blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ghosted_core.errors import GhostedError

MAX_BLOCKS = 4096  # more decoder blocks than any model has: a typed block list or depth range stays below it


def check_block_number(value: int, text: str) -> int:
    """`value` (a block index or a depth read from `text`), refused when it is beyond any model's blocks."""
    if value >= MAX_BLOCKS:
        raise GhostedError(f"{value} in {text!r} is beyond any model's blocks (at most {MAX_BLOCKS - 1}); "
                           "use the block numbers of your model")
    return value


@dataclass(frozen=True)
class Boundary:
    """Removed blocks `start … end-1`; the pruned model feeds h_start where the dense fed h_end."""

    start: int  # s: first removed block
    end: int  # s + n: first surviving block after the run (num_layers when the run reaches the end)

    @property
    def n(self) -> int:
        return self.end - self.start

    @property
    def blocks(self) -> range:
        return range(self.start, self.end)

    def __str__(self) -> str:
        return f"{self.start}-{self.end - 1}" if self.n > 1 else str(self.start)


def boundaries_of(removed: Iterable[int]) -> tuple[Boundary, ...]:
    """Group removed block indices into maximal contiguous runs, in order."""
    runs: list[Boundary] = []
    for index in sorted(set(removed)):
        if runs and runs[-1].end == index:
            runs[-1] = Boundary(runs[-1].start, index + 1)
        else:
            runs.append(Boundary(index, index + 1))
    return tuple(runs)


@dataclass(frozen=True)
class PruningPlan:
    """Blocks to remove, why, and the per-block scores behind the choice (for charts)."""

    num_layers: int
    removed: tuple[int, ...]
    criterion: str
    scores: tuple[float, ...] = ()  # one per candidate (block or run start); see score_label
    score_label: str = ""  # what a score means, e.g. "mean cos(h_s, h_s+n) over tokens"
    boundaries: tuple[Boundary, ...] = field(init=False)

    def __post_init__(self) -> None:
        removed = tuple(sorted(set(self.removed)))
        bad = [i for i in removed if not 0 <= i < self.num_layers]
        if bad:
            raise GhostedError(f"block(s) {bad} out of range: the model has blocks 0-{self.num_layers - 1}")
        if len(removed) >= self.num_layers:
            raise GhostedError(
                f"removing {len(removed)} of {self.num_layers} blocks leaves none; remove at most {self.num_layers - 1}"
            )
        object.__setattr__(self, "removed", removed)
        object.__setattr__(self, "boundaries", boundaries_of(removed))

    @property
    def kept(self) -> tuple[int, ...]:
        removed = set(self.removed)
        return tuple(i for i in range(self.num_layers) if i not in removed)

    def to_json(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "removed_layers": list(self.removed),
            "boundaries": [[b.start, b.end] for b in self.boundaries],
            "criterion": self.criterion,
            "scores": list(self.scores),
            "score_label": self.score_label,
        }
