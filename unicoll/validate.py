"""Checking a call against its operator's spec, on every rank, before any communication.

Each parameter is read according to its kind (an input array, counts, a group, ...) and
then every rule of the spec is checked; the first one that fails raises, naming the
operator, the parameter, what was expected and what was given.
"""

from __future__ import annotations

from typing import Any

from . import runtime
from .arrays import describe, device_kind, dtype_name, is_fillable, library_of
from .backends.base import Capabilities
from .counts import as_counts
from .errors import bad_input
from .spec import Call, OpSpec


def _array(op: str, param: str, x: Any, caps: Capabilities, backend: str) -> Any:
    lib = library_of(x)
    if lib not in caps.libraries:
        libraries = " or ".join(sorted(caps.libraries))
        raise bad_input(op, param, f"a {libraries} array (backend {backend!r})", describe(x), TypeError)
    if x.ndim < 1:
        raise bad_input(op, param, "an array with at least one dimension (rows are dimension 0)", describe(x))
    if dtype_name(x) not in caps.dtypes:
        raise bad_input(op, param, f"one of the dtypes {', '.join(sorted(caps.dtypes))}", describe(x), TypeError)
    if device_kind(x) not in caps.devices:
        raise bad_input(
            op, param, f"an array on {' or '.join(sorted(caps.devices))} (backend {backend!r})", describe(x)
        )
    return x


def _output(op: str, param: str, x: Any, caps: Capabilities, backend: str) -> Any:
    _array(op, param, x, caps, backend)
    if not is_fillable(x):
        raise bad_input(op, param, "a C-contiguous, writable array to fill in place", f"{describe(x)} that is not")
    return x


def _read(kind: str, op: str, param: str, value: Any, caps: Capabilities, backend: str) -> Any:
    if kind == "array":
        return _array(op, param, value, caps, backend)
    if kind == "optional_output":
        return None if value is None else _output(op, param, value, caps, backend)
    if kind == "gather_output":
        if isinstance(value, list):
            return [_output(op, f"{param}[{i}]", v, caps, backend) for i, v in enumerate(value)]
        return None if value is None else _output(op, param, value, caps, backend)
    if kind == "counts":
        return as_counts(value, op, param)
    if kind == "optional_counts":
        return None if value is None else as_counts(value, op, param)
    if kind == "flag":
        if not isinstance(value, bool):
            raise bad_input(op, param, "True or False", describe(value), TypeError)
        return value
    raise AssertionError(f"spec of {op}: unknown parameter kind {kind!r}")


def prepare(spec: OpSpec, arguments: dict[str, Any]) -> Call:
    """Read and check ``arguments`` (by parameter name) for ``spec``; returns the call, which
    also carries the running ``backend``, the ``group`` resolved, its size ``W`` and ``timeout``.

    Raises NotInitializedError before ``init``, TypeError/ValueError for a bad argument.
    """
    state = runtime.state(spec.name)
    group = runtime.resolve_group(arguments["group"], spec.name)
    backend = state.backend
    if spec.name not in backend.capabilities.ops:
        raise NotImplementedError(f"{spec.name}: backend {backend.name!r} does not provide this operator")
    call = Call(W=group.world_size, group=group, backend=backend, timeout=state.timeout, check=state.check)
    for param in spec.params:
        if param.kind != "group":
            value = _read(param.kind, spec.name, param.name, arguments[param.name], backend.capabilities, backend.name)
            setattr(call, param.name, value)
    for rule in spec.rules:
        given = rule.check(call)
        if given is not None:
            raise bad_input(spec.name, rule.param, rule.expected.replace("{W}", str(call.W)), given, rule.error)
    return call
