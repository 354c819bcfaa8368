"""What a session remembers of the calls the validator accepted (:mod:`unicoll.validate`).

The calls, keyed by the signatures of their arguments and bounded in bytes, and each operator's
count of the calls the memory could not serve. The session (:mod:`unicoll.runtime`) holds one
and lets it go with the session. What is remembered, and for how long, is the validator's rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cache import BoundedCache

MAX_BYTES = 16 * 2**20
"""The most a session's memory may hold: the calls' counts and what the calls derive from them
(split sizes, the MoE operators' plans and reorders)."""


@dataclass
class CallMemory:
    """One session's memory of accepted calls."""

    accepted: BoundedCache = field(default_factory=lambda: BoundedCache(MAX_BYTES))
    """The calls the validator accepted, by signature."""
    missed: dict = field(default_factory=dict)
    """Each operator's count of calls the memory could not serve, less a credit per call served."""

    def clear(self) -> None:
        """Forget every call (the counts of misses too)."""
        self.accepted.clear()
        self.missed.clear()
