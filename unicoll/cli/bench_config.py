"""What ``unicoll bench`` measures (:mod:`unicoll.cli.bench`): its operators, dtypes and the
:class:`Config` every rank gets as JSON."""

from __future__ import annotations

from dataclasses import dataclass

OPS: tuple[str, ...] = (
    "alltoall_single",
    "all_gather",
    "global_scatter",
    "global_gather",
    "all_reduce",
    "reduce_scatter",
    "broadcast",
    "moe_topk",
)
DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")


@dataclass(frozen=True)
class Config:
    """What to measure; the command line's options, passed to every rank as JSON."""

    backend: str | None
    ops: tuple[str, ...]
    min_bytes: int
    max_bytes: int
    dtype: str
    experts: int
    hidden: int
    iters: int
    warmup: int
    seed: int

    def sizes(self) -> list[int]:
        """The message sizes of the sweep: ``min_bytes`` doubling up to ``max_bytes``."""
        sizes, size = [], self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= 2
        return sizes
