"""The process-wide state: which backend runs, the world group, and the configured timeout.

``init`` reads the rank and world size from ``RANK``/``WORLD_SIZE`` (as torchrun and
``unicoll run`` set them; a lone process is rank 0 of 1; the ``mpi`` backend takes them from
MPI instead), the backend from its argument or
``UNICOLL_BACKEND``, and the timeout from its argument or ``UNICOLL_TIMEOUT``.

A child forked from an initialized process forgets the parent's session without touching it
(:func:`_forget_in_child`, :mod:`unicoll.forking`): unicoll refuses to run there, at once.

An exception that ends the program of a rank with peers ends it at once, even while other
threads run that are not daemons (:func:`_uncaught`): the interpreter would wait for them before
its exit, and the peers with it, in their collectives, until the timeout.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType

from . import forking, registry
from .backends.base import Backend
from .backends.stub import StubTransport
from .check import count_call, verify_barrier, verify_new_group
from .entry import exclusive
from .errors import NotInitializedError, translated
from .group import Group
from .memory import CallMemory
from .session import end_session
from .verify import VerifiedBackend, verify_setting

TIMEOUT_ENV_VAR = "UNICOLL_TIMEOUT"
CHECK_ENV_VAR = "UNICOLL_CHECK"
HANDSHAKE_ENV_VAR = "UNICOLL_HANDSHAKE"
DEFAULT_TIMEOUT = 300.0
MIN_TIMEOUT = 1e-3
"""The shortest timeout: the transports' stores count in milliseconds."""
MAX_TIMEOUT = 1e7
"""The longest timeout (about 116 days): torch's and MPI's waits take finite durations."""


@dataclass
class _State:
    backend: Backend
    world: Group
    timeout: float
    check: bool
    handshake: bool
    #: The validator's memory of the calls it accepted in this session (unicoll.memory).
    memory: CallMemory = field(default_factory=CallMemory)
    compare: bool = field(init=False)
    """Whether the ranks compare their calls before moving data: the handshake, or check mode
    (a field, not a property: every call reads it twice)."""

    def __post_init__(self) -> None:
        self.compare = self.check or self.handshake


_state: _State | None = None
_sessions = itertools.count()
_forked_from: int | None = None
"""The pid of the initialized process that this one was forked from (None where it was not)."""

_FINALIZED = (
    "its session ended at finalize(); make groups again with new_group() after init(), and wait for tasks "
    "before finalize()"
)
"""What a group or task of a session that :func:`finalize` ended says when it is used."""
_FORKED = "its session belongs to the process that this one was forked from"
"""What a group or task of the parent's session says when a forked child uses it."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"unicoll.init: ${name}: expected an integer, got {raw!r}") from None


def _timeout_setting(timeout: float | None) -> float:
    source = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV_VAR)
        if raw is None:
            return DEFAULT_TIMEOUT
        source = f"${TIMEOUT_ENV_VAR}"
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"unicoll.init: {source}: expected a number of seconds, got {raw!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"unicoll.init: {source}: expected a number of seconds, got {type(timeout).__name__}")
    if not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT:  # NaN fails too
        raise ValueError(
            f"unicoll.init: {source}: expected a number of seconds from {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g}, "
            f"got {timeout!r}"
        )
    return float(timeout)


def _switch_setting(name: str, given: bool | None, env_var: str, default: str) -> bool | None:
    """An on/off setting of ``init``: ``given``, else ``$env_var`` (0 or 1, false or true), else
    None (unset or empty: ``default`` says what that means)."""
    if given is not None:
        if not isinstance(given, bool):
            raise TypeError(f"unicoll.init: {name}: expected True, False or None, got {given!r}")
        return given
    raw = os.environ.get(env_var, "")
    setting = raw.strip().lower()
    if setting not in ("0", "1", "false", "true", ""):
        raise ValueError(
            f"unicoll.init: ${env_var}: expected 0 or 1 (or false or true; empty is {default}), got {raw!r}"
        )
    return None if setting == "" else setting in ("1", "true")


def init(
    backend: str | None = None,
    *,
    timeout: float | None = None,
    check: bool | None = None,
    handshake: bool | None = None,
    verify: bool | float | None = None,
) -> None:
    """Join the job: start the backend and the world group.

    ``backend``: ``"gloo"``, ``"torch-nccl"``, ``"cupy-nccl"``, ``"mpi"``, a registered name, ``"auto"``
    or None (then ``$UNICOLL_BACKEND``, else ``"auto"``). ``timeout``: seconds every
    operator may take (default ``$UNICOLL_TIMEOUT`` or 300). ``handshake``: the ranks compare
    what each call will move before it moves, so ranks that disagree get
    :class:`~unicoll.CrossRankMismatchError` instead of a crash or wrong rows (default
    ``$UNICOLL_HANDSHAKE``, else on for the host backends, gloo and mpi, and off for the GPU
    backends). ``check``: the handshake on every backend, and the issuing threads' names and
    the static mode's expert ids compared too (default ``$UNICOLL_CHECK``, off). ``verify``: the
    share of calls whose data is checked end to end, checksums of every block sent and
    received compared across the ranks (True or 1: every call; 0.01: one in a hundred; default
    ``$UNICOLL_VERIFY``, else off; see docs/reliability.md). On the torch backends an
    already initialized torch.distributed default group is adopted; otherwise the default
    group is created, so raw torch.distributed calls work beside unicoll.

    >>> import unicoll as uc
    >>> uc.init("gloo")            # doctest: +SKIP
    """
    global _state, _previous_excepthook
    if _forked_from is not None:
        raise RuntimeError(_forked_message("unicoll.init"))
    if _state is not None:
        raise RuntimeError(
            f"unicoll.init: already initialized with backend {_state.backend.name!r}; call finalize() first"
        )
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"unicoll.init: backend: expected a backend name (a str) or None, got {type(backend).__name__}")
    seconds = _timeout_setting(timeout)
    checking = bool(_switch_setting("check", check, CHECK_ENV_VAR, "0"))
    shaking = _switch_setting("handshake", handshake, HANDSHAKE_ENV_VAR, "the backend's default")
    rate = verify_setting(verify)
    name = registry.resolve(backend)
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"unicoll.init: $RANK: expected 0 <= RANK < WORLD_SIZE ({world_size}), got {rank}")
    started = registry.registered()[name](rank=rank, world_size=world_size, timeout=seconds)
    if rate > 0:
        started = VerifiedBackend(started, rate, seconds)
    world = Group(tuple(range(started.world_size)), None, started.rank, next(_sessions))
    _state = _State(started, world, seconds, checking, started.host_memory if shaking is None else shaking)
    atexit.register(finalize)  # a process that exits without finalize() still shuts down cleanly
    if sys.excepthook is not _uncaught:  # once per process: the hook it replaces stays the one it calls
        _previous_excepthook, sys.excepthook = sys.excepthook, _uncaught


def finalize() -> None:
    """Leave the job and release the backend; ``init`` may be called again afterwards.

    Every group of the session lets go of its transport handle first, so that groups, tasks
    and autograd graphs the caller still holds keep nothing of the old world alive; using one
    afterwards raises ValueError.
    """
    global _state
    atexit.unregister(finalize)
    if _state is not None:
        state, _state = _state, None
        end_session(state.world.session, _FINALIZED)
        state.backend.finalize()


def _uncaught(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
    """``sys.excepthook`` from the first :func:`init` on: the hook it replaced (which prints the
    exception); then, for an exception that ends the program (the interpreter has set
    ``sys.last_value`` to it) while this rank has peers and another thread that is not a daemon
    runs, the exit handlers at once (``finalize()``, and on mpi ``MPI_Abort``) and ``os._exit``
    with status 1 (130 for ``KeyboardInterrupt``), instead of waiting for that thread first."""
    _previous_excepthook(kind, value, traceback)
    main = threading.main_thread()
    if (
        value is not getattr(sys, "last_value", None)
        or threading.current_thread() is not main
        or sys.flags.interactive  # a prompt comes next: python -i, or the interactive interpreter (below)
        or hasattr(sys, "ps1")
        or _state is None
        or _state.world.world_size == 1
        or not any(thread is not main and not thread.daemon and thread.is_alive() for thread in threading.enumerate())
    ):
        return
    atexit._run_exitfuncs()
    forking.exit_at_once(130 if isinstance(value, KeyboardInterrupt) else 1)


_previous_excepthook = sys.excepthook
"""The ``sys.excepthook`` that :func:`_uncaught` replaced, which it calls first."""


def _forget_in_child() -> None:
    """In a child just forked from an initialized process: forget the parent's session without
    touching its transport, which the parent still uses (see :mod:`unicoll.forking`). The
    child never finalizes it, every call into unicoll there raises at once, and where MPI runs
    the child leaves without the interpreter's teardown, which would finalize MPI."""
    global _state, _forked_from
    if _state is None:
        return
    state, _state = _state, None
    _forked_from = os.getppid()
    atexit.unregister(finalize)
    end_session(state.world.session, _FORKED, keep_handles=True)
    state.backend.abandon()
    if forking.mpi_running():
        forking.exit_before_teardown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _forked_message(op: str) -> str:
    """The error for ``op`` called in a process forked from an initialized one."""
    return (
        f"{op}: this process was forked from process {_forked_from}, in which unicoll is initialized; "
        "a forked child can neither use the parent's connections nor start its own beside them: start "
        "worker processes with the 'spawn' start method (or as new programs) and call unicoll.init() there"
    )


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`finalize` has not since)."""
    return _state is not None


def state(op: str) -> _State:
    """The running state; NotInitializedError naming ``op`` before :func:`init` and in a
    process forked from an initialized one."""
    if _state is None:
        if _forked_from is not None:
            raise NotInitializedError(_forked_message(op))
        raise NotInitializedError(f"{op}: unicoll is not initialized: call unicoll.init() first")
    return _state


@contextmanager
def transport_stubbed() -> Iterator[None]:
    """Within the block, operators run all of unicoll's own work (validation, check mode,
    planning, conversion, the result) but move no bytes: the running backend's transfers do
    nothing and outputs keep what they held. For timing the front end on its own, as
    ``unicoll bench`` does; a world of one rank only, since the other ranks would wait for
    transfers that never come.

    >>> with transport_stubbed():  # doctest: +SKIP
    ...     uc.alltoall_single(out, x)  # out is left as it was
    """
    current = state("transport_stubbed")
    if current.world.world_size != 1:
        raise RuntimeError(
            f"transport_stubbed: expected a world of one rank, got {current.world.world_size} ranks "
            "(the others would wait for transfers that never come)"
        )
    real = current.backend
    current.memory.clear()  # remembered calls carry the backend they ran on
    current.backend = StubTransport(real)
    try:
        yield
    finally:
        current.memory.clear()
        current.backend = real


def resolve_group(group: Group | None, op: str) -> Group:
    """``group`` checked for use now by this rank, or the world group for None."""
    current = state(op)
    if group is None:
        return current.world
    if not isinstance(group, Group):
        raise TypeError(f"{op}: group: expected a unicoll.Group or None, got {type(group).__name__}")
    if group.session != current.world.session:
        raise ValueError(f"{op}: group: expected a group made since the last init(), got {group!r} from an earlier one")
    if not group.is_member:
        raise ValueError(
            f"{op}: group: expected a group this rank belongs to, "
            f"got {group!r} (this is world rank {current.backend.rank})"
        )
    return group


def get_backend() -> str:
    """Name of the running backend: ``"gloo"``, ``"torch-nccl"``, ``"cupy-nccl"`` or a registered one."""
    return state("get_backend").backend.name


def get_rank(group: Group | None = None) -> int:
    """This process's rank in ``group`` (the world when None)."""
    return resolve_group(group, "get_rank").rank


def get_world_size(group: Group | None = None) -> int:
    """Number of ranks in ``group`` (the world when None)."""
    return resolve_group(group, "get_world_size").world_size


@exclusive
def new_group(ranks: Sequence[int]) -> Group:
    """A group of the given world ranks; every rank of the world must call it with the same
    ranks, members or not. The lists are compared across the world first (always, check mode
    or not): ranks that disagree get :class:`~unicoll.CrossRankMismatchError` on every rank.

    >>> pair = uc.new_group([0, 1])   # doctest: +SKIP
    """
    current = state("new_group")
    if current.compare:
        count_call(current.world)
    try:
        members, error = _members(ranks, current.world.world_size), None
    except (TypeError, ValueError) as exc:
        members, error = None, exc
    with translated("new_group", current.world, current.timeout):
        verify_new_group(current.backend, current.world, members)
        if error is not None:
            raise error
        handle = current.backend.new_group(members)
    return Group(members, handle, current.backend.rank, current.world.session)


def _members(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``ranks`` checked and sorted; TypeError/ValueError naming ``new_group`` and ``ranks``."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"new_group: ranks: expected a sequence of ints, got {type(ranks).__name__}")
    if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size for r in ranks) or not ranks:
        raise ValueError(
            f"new_group: ranks: expected a non-empty list of world ranks in [0, {world_size}), got {list(ranks)}"
        )
    members = tuple(sorted(ranks))
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks: expected distinct ranks, got {list(ranks)}")
    return members


@exclusive
def barrier(group: Group | None = None) -> None:
    """Block until every rank of ``group`` reaches the barrier."""
    resolved = resolve_group(group, "barrier")
    current = state("barrier")
    if current.compare:
        count_call(resolved)
    with translated("barrier", resolved, current.timeout):
        if current.compare:
            verify_barrier(current.backend, resolved)
        current.backend.barrier(resolved)
