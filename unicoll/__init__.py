"""unicoll: one framework-agnostic API for Mixture-of-Experts collectives.

The MoE exchanges (``global_scatter``, ``global_gather``), the all-to-alls and the rest of a
training step's collectives (every operator of :data:`unicoll.spec.SPECS`; docs/api.md lists
them) take numpy, torch, cupy, Paddle or JAX arrays, return the same kind, and run on the
backend chosen at run time (``init(backend=...)`` > ``$UNICOLL_BACKEND`` > ``"auto"``).
``unicoll.moe`` builds top-k token dispatch and combine on them.

>>> import unicoll as uc
>>> uc.init("gloo")                                              # doctest: +SKIP
>>> y = uc.global_scatter(x, local_count, uc.exchange_counts(local_count))   # doctest: +SKIP
>>> rows, rows_per_expert, handle = uc.moe.dispatch(x, topk_idx, topk_weights, experts_per_rank=2)  # doctest: +SKIP
"""

from __future__ import annotations

from . import backends, face, moe, reference
from .errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    CommunicationError,
    CrossRankMismatchError,
    IntegrityError,
    NotInitializedError,
    PeerLostError,
)
from .face import *  # noqa: F403  (the public operators: face.__all__)
from .group import Group
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

del backends


def __getattr__(name: str) -> object:
    """``uc.testing`` imported on first use: it loads multiprocessing and subprocess, which a
    training program does not need; ``uc.__version__`` read on first use (importlib.metadata
    loads the email package, and socket with it)."""
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("unicoll")
        except PackageNotFoundError:  # running from a source tree that is not installed
            found = "0+unknown"
        globals()["__version__"] = found
        return found
    raise AttributeError(f"module 'unicoll' has no attribute {name!r}")


__all__ = [
    *face.__all__,
    "BackendUnavailableError",
    "CollectiveTimeoutError",
    "CommunicationError",
    "CrossRankMismatchError",
    "IntegrityError",
    "Group",
    "NotInitializedError",
    "PeerLostError",
    "Task",
    "__version__",  # noqa: F405  (read on first use, by __getattr__)
    "barrier",
    "finalize",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "moe",
    "new_group",
    "reference",
    "register_backend",
    "testing",  # noqa: F405  (imported on first use, by __getattr__)
]
