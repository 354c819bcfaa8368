"""Checking a call against its operator's spec, on every rank, before any communication.

Each parameter is read according to its kind (an input array, counts, a group, ...) and
then every rule of the spec is checked; the first one that fails raises, naming the
operator, the parameter, what was expected and what was given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import runtime
from .arrays import NON_NATIVE, describe, is_fillable, kind_of, library_of
from .backends.base import Capabilities
from .check import count_call
from .counts import as_counts
from .errors import bad_input
from .spec import Call, OpSpec


def _array(op: str, param: str, x: Any, caps: Capabilities, backend: str) -> Any:
    if library_of(x) not in caps.libraries:
        libraries = " or ".join(sorted(caps.libraries))
        raise bad_input(op, param, f"a {libraries} array (backend {backend!r})", describe(x), TypeError)
    if x.ndim < 1:
        raise bad_input(op, param, "an array with at least one dimension (rows are dimension 0)", describe(x))
    kind = kind_of(x)
    if kind.dtype.endswith(NON_NATIVE):
        expected = "an array in native byte order (convert it with x.astype(x.dtype.newbyteorder('=')))"
        raise bad_input(op, param, expected, describe(x), TypeError)
    if kind.dtype not in caps.dtypes:
        raise bad_input(op, param, f"one of the dtypes {', '.join(sorted(caps.dtypes))}", describe(x), TypeError)
    if kind.device not in caps.devices:
        raise bad_input(
            op, param, f"an array on {' or '.join(sorted(caps.devices))} (backend {backend!r})", describe(x)
        )
    return x


def _output(op: str, param: str, x: Any, caps: Capabilities, backend: str) -> Any:
    _array(op, param, x, caps, backend)
    if not is_fillable(x):
        raise bad_input(op, param, "a C-contiguous, writable array to fill in place", f"{describe(x)} that is not")
    return x


def _optional_output(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return None if value is None else _output(op, param, value, caps, backend)


def _gather_output(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if isinstance(value, list):
        return [_output(op, f"{param}[{i}]", v, caps, backend) for i, v in enumerate(value)]
    return _optional_output(op, param, value, caps, backend)


def _counts(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return as_counts(value, op, param)


def _optional_counts(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    return None if value is None else as_counts(value, op, param)


def _flag(op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if value is not True and value is not False:
        raise bad_input(op, param, "True or False", describe(value), TypeError)
    return value


#: How each kind of parameter (:attr:`unicoll.spec.Param.kind`) is read and checked.
_READERS: dict[str, Callable[[str, str, Any, Capabilities, str], Any]] = {
    "array": _array,
    "optional_output": _optional_output,
    "gather_output": _gather_output,
    "counts": _counts,
    "optional_counts": _optional_counts,
    "flag": _flag,
}

# -- signatures: what a reader's verdict depends on ------------------------------------------
#
# A call whose arguments have the signatures of a call already accepted in this session is
# accepted again without reading its arguments: every reader and rule depends only on what
# the signature holds (library, dtype, device, shape and fillability of arrays; the type,
# shape and values of counts; the type and value of flags). None marks an argument that is
# not remembered (a list of outputs, counts on a GPU, anything unexpected): the call is then
# read in full.


def _array_signature(x: Any) -> Any:
    return (kind_of(x), x.shape) if library_of(x) is not None else None


def _output_signature(x: Any) -> Any:
    if x is None:
        return ()
    return (kind_of(x), x.shape, is_fillable(x)) if library_of(x) is not None else None


def _counts_signature(value: Any) -> Any:
    if value is None:
        return ()
    kind = type(value)
    if kind is list or kind is tuple:
        return (kind, tuple(value), tuple(map(type, value)))
    library = library_of(value)
    if library == "numpy":
        return (kind_of(value), value.shape, value.tobytes())
    if library == "torch" and value.device.type == "cpu":
        return (kind_of(value), value.shape, value.numpy().tobytes())
    return None


def _flag_signature(value: Any) -> Any:
    return value if type(value) is bool else None


_SIGNATURES: dict[str, Callable[[Any], Any]] = {
    "array": _array_signature,
    "optional_output": _output_signature,
    "gather_output": lambda v: None if isinstance(v, list) else _output_signature(v),
    "counts": _counts_signature,
    "optional_counts": _counts_signature,
    "flag": _flag_signature,
}

#: Parameter kinds whose value the call carries as given (arrays); the others are read once.
_PASSED_THROUGH = frozenset({"array", "optional_output", "gather_output"})

_ENTRY_OVERHEAD = 1024
"""Bytes counted per remembered call beside its counts: the key's and the call's objects."""


def prepare(spec: OpSpec, arguments: dict[str, Any]) -> Call:
    """Read and check ``arguments`` (by parameter name) for ``spec``; returns the call, which
    also carries the running ``backend``, the ``group`` resolved, its size ``W`` and ``timeout``.

    A call with the same signature as one accepted before (see above) reuses what was read
    then, so the steady state of a training loop costs a few dictionary lookups. The memory
    of accepted calls keeps copies of counts, never the caller's arrays, and is bounded by
    :data:`unicoll.runtime.ACCEPTED_CACHE_BYTES`.

    Raises NotInitializedError before ``init``, TypeError/ValueError for a bad argument.
    """
    state = runtime.state(spec.name)
    group = runtime.resolve_group(arguments["group"], spec.name)
    if state.check:
        count_call(group)
    key = (spec.name, group, *[_SIGNATURES[p.kind](arguments[p.name]) for p in spec.params if p.kind != "group"])
    try:
        accepted = None if None in key else state.accepted.get(key)
    except TypeError:  # an unhashable argument, such as counts given as a list of lists
        return _read_call(spec, arguments, state, group)
    if accepted is None:
        call = _read_call(spec, arguments, state, group)
        if None not in key:
            kept = _frozen(call, spec)
            state.accepted.put(key, kept, _remembered_bytes(kept, spec))
        return call
    call = Call(**vars(accepted))
    for param in spec.params:
        if param.kind in _PASSED_THROUGH:
            setattr(call, param.name, arguments[param.name])
    return call


def _frozen(call: Call, spec: OpSpec) -> Call:
    """A copy of ``call`` to remember: counts copied and read-only, as the caller's may change;
    the caller's arrays left out (a call taken from memory gets the new call's arrays)."""
    kept = Call(**vars(call))
    for param in spec.params:
        value = getattr(call, param.name, None)
        if param.kind in _PASSED_THROUGH:
            setattr(kept, param.name, None)
        elif param.kind.endswith("counts") and value is not None:
            value = value.copy()
            value.flags.writeable = False
            setattr(kept, param.name, value)
    return kept


_BYTES_PER_COUNT = 72
"""Bytes counted per count remembered: its int64 copy in the call and, in the key, its bytes
or, for counts given as a list, a tuple of ints and one of their types."""


def _remembered_bytes(kept: Call, spec: OpSpec) -> int:
    """What remembering ``kept`` (and its key) costs, counted from its counts."""
    counts = [getattr(kept, p.name) for p in spec.params if p.kind.endswith("counts")]
    return _BYTES_PER_COUNT * sum(c.size for c in counts if c is not None) + _ENTRY_OVERHEAD


def _read_call(spec: OpSpec, arguments: dict[str, Any], state: Any, group: Any) -> Call:
    """Every parameter read by its kind's reader, then every rule of ``spec`` checked."""
    backend = state.backend
    if spec.name not in backend.capabilities.ops:
        raise NotImplementedError(f"{spec.name}: backend {backend.name!r} does not provide this operator")
    caps, op = backend.capabilities, spec.name
    call = Call(W=group.world_size, group=group, backend=backend, timeout=state.timeout, check=state.check)
    for param in spec.params:
        if param.kind != "group":
            setattr(call, param.name, _READERS[param.kind](op, param.name, arguments[param.name], caps, backend.name))
    for rule in spec.rules:
        given = rule.check(call)
        if given is not None:
            raise bad_input(spec.name, rule.param, rule.expected.replace("{W}", str(call.W)), given, rule.error)
    return call
