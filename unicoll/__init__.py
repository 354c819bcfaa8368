"""unicoll: one framework-agnostic API for Mixture-of-Experts collectives.

``global_scatter``, ``global_gather``, ``all_gather`` and ``alltoall_single`` take numpy,
torch or cupy arrays, return the same kind, and run on the backend chosen at run time
(``init(backend=...)`` > ``$UNICOLL_BACKEND`` > ``"auto"``). ``unicoll.moe`` builds top-k
token dispatch and combine on them.

>>> import unicoll as uc
>>> uc.init("gloo")                                              # doctest: +SKIP
>>> y = uc.global_scatter(x, local_count, uc.exchange_counts(local_count))   # doctest: +SKIP
>>> rows, rows_per_expert, handle = uc.moe.dispatch(x, topk_idx, topk_weights, experts_per_rank=2)  # doctest: +SKIP
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import backends, moe, reference
from .errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    CrossRankMismatchError,
    NotInitializedError,
    PeerLostError,
)
from .group import Group
from .ops import all_gather, alltoall_single, exchange_counts, global_gather, global_scatter
from .registry import register_backend
from .runtime import (
    barrier,
    finalize,
    get_backend,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    new_group,
)
from .task import Task

try:
    __version__ = version("unicoll")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

del backends, version, PackageNotFoundError


def __getattr__(name: str) -> object:
    """``uc.testing`` imported on first use: it loads multiprocessing and subprocess, which a
    training program does not need."""
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module 'unicoll' has no attribute {name!r}")


__all__ = [
    "BackendUnavailableError",
    "CollectiveTimeoutError",
    "CommunicationError",
    "CrossRankMismatchError",
    "Group",
    "NotInitializedError",
    "PeerLostError",
    "Task",
    "__version__",
    "all_gather",
    "alltoall_single",
    "barrier",
    "exchange_counts",
    "finalize",
    "get_backend",
    "get_rank",
    "get_world_size",
    "global_gather",
    "global_scatter",
    "init",
    "is_initialized",
    "moe",
    "new_group",
    "reference",
    "register_backend",
    "testing",
]
