"""A spec binds a call to the operator's parameters as ``inspect.Signature.bind`` with
``apply_defaults`` does (:meth:`unicoll.spec.OpSpec.bind`, which the carry floor and the traced
forms use), and the carry floor refuses what ``inspect`` refuses, naming the operator."""

from __future__ import annotations

import functools
import inspect

import pytest

import unicoll as uc
from unicoll import carry
from unicoll.spec import SPECS


def _eager(name: str):
    """The eager function of the public operator ``name`` ("moe.dispatch")."""
    return functools.reduce(getattr, name.split("."), uc).__wrapped__


def _calls(signature: inspect.Signature):
    """Calls of every shape the signature takes: each split of its parameters between
    positional and keyword arguments, with and without the defaulted ones."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword_only = [p for p in params if p.kind is p.KEYWORD_ONLY]
    for filled in (False, True):
        chosen = [p for p in positional if filled or p.default is p.empty]
        required_kw = {p.name: f"v-{p.name}" for p in keyword_only if filled or p.default is p.empty}
        for cut in range(len(chosen) + 1):
            args = tuple(f"v-{p.name}" for p in chosen[:cut])
            kwargs = {p.name: f"v-{p.name}" for p in chosen[cut:]} | required_kw
            yield args, kwargs


@pytest.mark.parametrize("name", sorted(SPECS))
def test_binding_matches_inspect(name: str) -> None:
    signature = inspect.signature(_eager(name))
    for args, kwargs in _calls(signature):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        assert list(SPECS[name].bind(args, kwargs).items()) == list(bound.arguments.items()), (args, kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("x",), {}, "missing a required argument: 'topk_idx'"),
        (("x", "ids"), {}, "missing a required argument: 'experts_per_rank'"),
        (("x", "ids", None, 2), {}, "too many positional arguments"),
        (("x", "ids"), {"x": 1, "experts_per_rank": 2}, "multiple values for argument 'x'"),
        (("x", "ids"), {"experts_per_rank": 2, "expert": 1}, "got an unexpected keyword argument 'expert'"),
    ],
)
def test_a_call_that_does_not_bind_is_refused_naming_the_operator(args, kwargs, message) -> None:
    assert SPECS["moe.dispatch"].bind(args, kwargs) is None
    with pytest.raises(TypeError, match=rf"^moe\.dispatch: {message}$"):
        carry._bound(SPECS["moe.dispatch"], _eager("moe.dispatch"), args, kwargs)
