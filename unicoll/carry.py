"""Operators on a joined library's arrays (Paddle, JAX: :mod:`unicoll.libraries`): the call
runs on torch tensors over the same memory, and its results come back as the caller's arrays,
with gradients through the caller's own autograd.

:func:`call` binds the arguments, gives each of the library's arrays a carrier (a torch
tensor read through DLPack: a leaf that requires grad where the library records a gradient,
a copy where the library's arrays are immutable or its autograd records a change in place),
runs the eager operator on the carriers while messages name the caller's arrays
(:func:`unicoll.libraries.carrying`), and hands every result back as the caller's kind of
array: outputs it passed are filled in place and returned, new ones are the library's. Where
the library records a gradient, the call runs in :attr:`~unicoll.libraries.ArrayLibrary.differentiate`,
whose backward is ``torch.autograd.grad`` over the carriers: the operator's one backward, as
torch's autograd runs it. Inside ``jax.jit`` the static-shape MoE operators run as host
callbacks (:mod:`unicoll.compiled.jax_static`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from .arrays import CARRIER, describe, library_of
from .errors import bad_input
from .kinds import ROUTER_IDS
from .libraries import NATIVE, ArrayLibrary, array_type, carrying, joined
from .routing import Handle
from .spec import SPECS, OpSpec
from .static_layout import StaticHandle
from .task import Task

_handle_weights: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
"""For each handle a dispatch made from a joined library's arrays: the caller's weights (None
where they need no gradient) and their carrier. A later combine's gradient reaches the
caller's weights through them."""


def holds_joined(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments hold a joined library's array."""
    for value in (*args, *kwargs.values()):
        if _joined_library(value) is not None:
            return True
        if type(value) is list and any(_joined_library(v) is not None for v in value):
            return True
    return False


def _joined_library(value: Any) -> ArrayLibrary | None:
    library = library_of(value)
    return None if library is None or library in _OWN else joined()[library]


_OWN = frozenset(NATIVE)
"""The libraries whose arrays the backends take as they are."""


def _weights_of(handle: Any) -> Any | None:
    """The caller's weights that need a gradient, of a handle a joined library's dispatch made."""
    if not isinstance(handle, (Handle, StaticHandle)) or handle not in _handle_weights:
        return None
    return _handle_weights[handle][0]


def _bound(spec: OpSpec, eager: Callable, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by parameter name, defaults filled in (:meth:`~unicoll.spec.OpSpec.bind`);
    a call that does not bind gets ``inspect``'s TypeError, naming the operator."""
    arguments = spec.bind(args, kwargs)
    if arguments is not None:
        return arguments
    try:
        inspect.signature(eager).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{spec.name}: {exc}") from None
    raise AssertionError(f"{spec.name}: the spec's parameters differ from the operator's signature")


def call(name: str, eager: Callable, locked: Callable, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The public operator ``name`` (its eager function ``eager``, ``locked`` under the lock)
    on arguments that hold a joined library's arrays (see the module's docstring)."""
    spec = SPECS[name]
    arguments = _bound(spec, eager, args, kwargs)
    held, arrays = _arrays(arguments)
    libraries = {lib.name: lib for _, lib in arrays}
    if len(libraries) > 1:
        given = " and ".join(lib.array_type for lib in libraries.values())
        raise bad_input(name, "arguments", "arrays of one joined library", given, TypeError)
    (library,) = libraries.values()
    _refuse_others(spec, arguments, library)
    if library.is_traced([array for array, _ in arrays]):
        from .compiled import jax_static  # the one joined library with a compiler: JAX

        return jax_static.call(name, spec, arguments)
    inputs = [array for array, _ in arrays if library.needs_grad(array)]
    if _weights_of(arguments.get("handle")) is not None:
        inputs.append(_weights_of(arguments["handle"]))  # combine's gradient reaches dispatch's weights
    run = _Run(spec, locked, library, arguments, held, inputs)
    if not inputs:
        return run.result(run([])[0])
    if arguments.get("sync_op") is False and library.grad_transform is not None:
        raise bad_input(name, "sync_op", f"True for arrays that {library.grad_transform} traces", "False")
    return run.result(library.differentiate(run, inputs, name))


def _arrays(arguments: dict[str, Any]) -> tuple[list[str], list[tuple[Any, ArrayLibrary]]]:
    """The names of the ``arguments`` to carry (those that hold a joined library's arrays, and
    every list: an empty one may be an output to fill), and the joined library's arrays among
    them, in order, each with its library."""
    held: list[str] = []
    arrays: list[tuple[Any, ArrayLibrary]] = []
    for name, value in arguments.items():
        count = len(arrays)
        for v in value if type(value) is list else (value,):
            library = _joined_library(v)
            if library is not None:
                arrays.append((v, library))
        if len(arrays) > count or type(value) is list:
            held.append(name)
    return held, arrays


def _refuse_others(spec: OpSpec, arguments: dict[str, Any], library: ArrayLibrary) -> None:
    """TypeError for an array of another library (numpy, torch, cupy) where the operator takes
    the call's arrays, beside ``library``'s (counts and moe.dispatch's ids, read on the host, may
    be of any library): its carriers are torch tensors, so the validator could not tell a torch
    tensor from one of them."""
    for name, value in arguments.items():
        kind = spec.kinds[name]
        if not (kind.passed_through or kind is ROUTER_IDS):
            continue
        for v in value if type(value) is list else (value,):
            if library_of(v) not in (None, library.name):
                expected = f"{array_type(library.name)} (the library of the call's other arrays)"
                raise bad_input(spec.name, name, expected, describe(v), TypeError)


def _differentiable(library: ArrayLibrary, value: Any) -> bool:
    return library_of(value) == library.name and library.needs_grad(value)


class _Run:
    """One call on carriers: :meth:`__call__` runs it on the values given for the inputs that
    need a gradient and returns its differentiable outputs, as the caller's arrays, with their
    backward; :meth:`result` hands back the whole result with the linked outputs in their
    places (a Task's at ``wait()``)."""

    def __init__(
        self,
        spec: OpSpec,
        locked: Callable,
        library: ArrayLibrary,
        arguments: dict[str, Any],
        held: list[str],
        inputs: list[Any],
    ) -> None:
        self.spec, self.locked, self.library, self.arguments, self.inputs = spec, locked, library, arguments, inputs
        self.held = held  # the names of the arguments to carry (see _arrays)
        self.returned: Any = None
        self.tensors: list[Any] = []

    def __call__(self, values: list[Any]) -> tuple[list[Any], Callable[[list[Any]], list[Any]]]:
        given = dict(zip(map(id, self.inputs), values))
        self.leaves: list[Any] = []  # one per input: the carrier autograd differentiates by, None for none
        self.origins: dict[int, Any] = {}  # carrier id -> the caller's array, for messages
        self.filled: dict[int, Any] = {}  # carrier (or carrier list) id -> the caller's output it fills
        self.in_place: dict[int, Any] = {}  # recorded copy id -> the caller's array its values go back to
        self.like: Any = None  # the first array carried: results come back on its device
        self.carried = dict(self.arguments)
        for name in self.held:
            self.carried[name] = self._carry(name, self.arguments[name], given)
        if _weights_of(self.arguments.get("handle")) is not None:
            self.leaves.append(_handle_weights[self.arguments["handle"]][1])
        with carrying(self.origins):
            self.returned = self.locked(**self.carried)
        for written in self._written():  # accepted and issued: its outputs are (being) written
            self.library.mark_written(written)
        if isinstance(self.returned, Task):
            return [], _no_backward
        return self._linked(self.returned)

    def _written(self) -> list[Any]:
        """The caller's arrays the call writes in place: those filled through their memory, and
        those whose values a recorded copy's come back to."""
        filled = [part for value in self.filled.values() for part in (value if type(value) is list else [value])]
        return [*filled, *self.in_place.values()]

    def _linked(self, returned: Any) -> tuple[list[Any], Callable[[list[Any]], list[Any]]]:
        """The differentiable outputs of ``returned`` (torch tensors autograd records) as the
        caller's arrays, and their backward: ``torch.autograd.grad`` over the carriers."""
        self.tensors = [t for t in _tensors(returned) if t.requires_grad]
        outputs = [self._own(t) for t in self.tensors]
        tensors, leaves, library, like = self.tensors, self.leaves, self.library, self.like

        def backward(grads: list[Any]) -> list[Any]:
            import torch

            pairs = [(t, library.to_torch(g)) for t, g in zip(tensors, grads) if g is not None]
            wanted = [leaf for leaf in leaves if leaf is not None]
            if not pairs or not wanted:
                return [None] * len(leaves)
            computed = iter(torch.autograd.grad(
                [t for t, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True, retain_graph=True
            ))  # fmt: skip
            given = [None if leaf is None else next(computed) for leaf in leaves]
            return [None if g is None else library.from_torch(g, like) for g in given]

        return outputs, backward

    def result(self, outputs: list[Any]) -> Any:
        """The call's result as the caller gets it, ``outputs`` (:meth:`__call__`'s, linked)
        in the differentiable tensors' places; for a Task, a Task whose ``wait()`` does that."""
        if isinstance(self.returned, Task):
            return self.returned._then(self._waited)
        return self._back(self.returned, dict(zip(map(id, self.tensors), outputs)))

    def _waited(self, returned: Any) -> Any:
        """A Task's result as the caller gets it, linked in the library's autograd now."""
        if self.inputs:
            outputs = self.library.differentiate(lambda values: self._linked(returned), self.inputs, self.spec.name)
        else:
            outputs = self._linked(returned)[0]
        return self._back(returned, dict(zip(map(id, self.tensors), outputs)))

    def _back(self, value: Any, linked: dict[int, Any]) -> Any:
        if id(value) in self.filled:
            original = self.filled[id(value)]
            if type(original) is list and not original:
                original.extend(self._back(part, linked) for part in value)
            return original
        if id(value) in linked:
            return linked[id(value)]
        if type(value) is tuple:
            return tuple(self._back(part, linked) for part in value)
        if type(value) is list:
            return [self._back(part, linked) for part in value]
        if isinstance(value, (Handle, StaticHandle)):
            if isinstance(value, StaticHandle):  # its counts and kept slots in the caller's library
                value.counts, value.received_before_drop, value.sent_before_drop, value.kept = (
                    self._back(part, linked)
                    for part in (value.counts, value.received_before_drop, value.sent_before_drop, value.kept)
                )
            weights = self.arguments.get("topk_weights")
            _handle_weights[value] = (weights if _differentiable(self.library, weights) else None,
                                      self.carried.get("topk_weights"))  # fmt: skip
            return value
        return self._own(value) if library_of(value) == CARRIER else value

    def _own(self, tensor: Any) -> Any:
        """A result tensor as the caller's array: the caller's own array where the tensor is a
        copy recorded in place (its values copied back), else a new one over its memory."""
        original = self.in_place.get(id(tensor))
        if original is None:
            return self.library.from_torch(tensor, self.like)
        self.library.to_torch(original).copy_(tensor.detach())
        return original

    def _carry(self, name: str, value: Any, given: dict[int, Any]) -> Any:
        """The carrier of one argument (a list's entries each), or the argument itself."""
        if type(value) is list:
            carried = [self._carry_array(name, v, given) for v in value]
            if self.spec.kinds[name].fills:
                self.filled[id(carried)] = value
            return carried
        return self._carry_array(name, value, given)

    def _carry_array(self, name: str, value: Any, given: dict[int, Any]) -> Any:
        library, kind = self.library, self.spec.kinds[name]
        if library_of(value) != library.name:
            return value
        if kind.fills and not kind.in_place and not library.writable:
            expected = f"None ({library.array_type} cannot be filled in place: the operator returns a new array)"
            raise bad_input(self.spec.name, name, expected, describe(value), TypeError)
        devices = library.device_count(value)
        if devices > 1:
            expected = f"{array_type(library.name)} on one device"
            raise bad_input(self.spec.name, name, expected, f"{describe(value)} sharded over {devices} devices")
        source = given.get(id(value), value)
        if self.like is None:
            self.like = source
        carrier = library.to_torch(source)
        self.origins[id(carrier)] = value
        if id(value) in given:
            if kind.fills and library.is_leaf(value):
                expected = (
                    f"a tensor autograd lets change in place (for a leaf that requires grad: {library.grad_hint})"
                )
                raise bad_input(self.spec.name, name, expected, f"a leaf {describe(value)} that requires grad")
            leaf = carrier.detach().requires_grad_() if carrier.is_floating_point() else None
            self.leaves.append(leaf)
            if leaf is not None:
                carrier = leaf
        if not kind.fills:
            return carrier
        if carrier.requires_grad or not library.writable:  # changed in place on a copy autograd records
            carrier = carrier.clone()
            self.origins[id(carrier)] = value
            if library.writable:
                self.in_place[id(carrier)] = value
            return carrier
        self.filled[id(carrier)] = value
        return carrier


def _no_backward(grads: list[Any]) -> list[Any]:
    return []


def _tensors(value: Any) -> list[Any]:
    """The torch tensors in a returned value (tuples and lists walked)."""
    if type(value) in (tuple, list):
        return [t for part in value for t in _tensors(part)]
    return [value] if library_of(value) == CARRIER else []
