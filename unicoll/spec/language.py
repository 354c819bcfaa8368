"""The language the operator specs are written in (:mod:`unicoll.spec`): a parameter
(:class:`Param`, its kind from :mod:`unicoll.kinds`), a rule (:class:`Rule`), how a data
operator traces under torch.compile (:class:`Traced`) and an entry point (:class:`OpSpec`).
A rule checks a :class:`PreparedCall`: a :class:`unicoll.spec.Call`, whose fields the specs
make."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..kinds import GROUP, REDUCE_OP, Kind


class PreparedCall:
    """A call prepared from its spec, as rules and plans read it: :class:`unicoll.spec.Call`,
    which the specs' tables make from their parameter names (this is its base)."""

    __slots__ = ()


REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One parameter: its ``kind`` says how the front end reads, remembers and documents it."""

    name: str
    kind: Kind
    annotation: str
    doc: str
    default: Any = REQUIRED
    keyword_only: bool = False


@dataclass(frozen=True)
class Rule:
    """What a parameter must satisfy once every parameter has been read."""

    param: str
    expected: str
    check: Callable[[PreparedCall], str | None]
    error: type[Exception] = ValueError


@dataclass(frozen=True)
class Traced:
    """How a data operator traces under torch.compile: as one custom op generated from its spec
    (:mod:`unicoll.compiled.custom_ops`), which takes the spec's parameters that have a schema
    type (:attr:`unicoll.kinds.Kind.schema`) but ``sync_op``, runs the eager operator and has a
    backward op that runs the eager backward (``<name>_backward`` in :mod:`unicoll.eager.ops`).
    """

    like: str
    """The array parameter whose dtype, device and trailing shape the result has, and which the
    gradient goes to."""
    rows: Callable[[dict[str, Any], int], Any] | None = None
    """The result's rows while tracing, from the call's arguments by name and the group size: an
    int (or a size of the traced shapes) where the arguments say them, None for a new dynamic
    size; itself None where the result has ``like``'s whole shape."""
    learns: tuple[str, ...] = ()
    """What a call learns that its backward needs: lists of one int per rank (the split sizes
    an exchange brought, say; :func:`unicoll.eager.ops.with_learned`)."""
    backward: tuple[str, ...] | None = ()
    """What the backward takes after the gradient, in order: parameters of the call, lists it
    learned, or ``"plan"``: what the spec's :attr:`OpSpec.plan` derives from the call's counts;
    None for an operator without a gradient."""


@dataclass(frozen=True, eq=False)
class OpSpec:
    """An entry point: what it does, its parameters and rules, how its gradient flows.

    ``in_capabilities``: whether backends list it in their capability table
    (:attr:`unicoll.backends.base.Capabilities.ops`); the data operators are, while
    ``exchange_counts`` runs on every backend's integer exchange. ``plan``: what the operator
    derives from a call that passed the rules, computed once and remembered with the call
    (:attr:`unicoll.spec.Call.plan`): a tuple of lists of ints (split sizes, say), an object that says
    what it holds in ``nbytes`` (the MoE operators' :class:`~unicoll.backends.layout.MoePlan`)
    or None, which nothing may change. ``checked_as``: the entry point whose cross-rank
    comparison check mode runs for this one's calls (None: its own, in
    :data:`unicoll.check.CHECKS`), for an operator that moves what another one moves.
    ``backward``: its gradient in words, for an operator without a backward function of its own
    (``<name>_backward`` in :mod:`unicoll.eager.ops`, whose docstring says it otherwise).
    ``reads_host``: whether a call reads array values on the host (a synchronization with a GPU);
    ``static_shapes``: whether every output shape follows from the arguments' shapes (what
    torch.compile needs to trace a call without dynamic shapes); the MoE modes' table on the API
    page is made from these two (:data:`MOE_MODES`). ``traced``: how a data operator traces
    (None: it runs eagerly behind one graph break, or, for unicoll.moe's, by a form of its own).
    ``agree``: parameters whose values every rank must pass alike, which check mode compares
    with the rows of the operator's array where :data:`unicoll.check.CHECKS` has no comparison
    of its own. Specs compare by identity, as check mode keys its comparisons by them.
    """

    name: str
    summary: str
    params: tuple[Param, ...]
    rules: tuple[Rule, ...]
    backward: str = ""
    in_capabilities: bool = True
    plan: Callable[[PreparedCall], Any] | None = None
    checked_as: OpSpec | None = None
    reads_host: bool = False
    static_shapes: bool = True
    traced: Traced | None = None
    agree: tuple[str, ...] = ()

    kinds: dict[str, Kind] = field(init=False, repr=False)
    """Each parameter's kind by its name."""
    signed: tuple[tuple[str, Callable[[Any], Any]], ...] = field(init=False, repr=False)
    """``(name, signature function)`` of each parameter that goes into the key of an accepted
    call (every one but the group)."""
    readers: tuple[tuple[str, Callable[..., Any]], ...] = field(init=False, repr=False)
    """``(name, reader)`` of each parameter that has a reader (every one but the group)."""
    passed_through: tuple[str, ...] = field(init=False, repr=False)
    """Names of the parameters whose value the call carries as given."""
    counted: tuple[str, ...] = field(init=False, repr=False)
    """Names of the parameters whose read value is a counts array."""
    positional: tuple[str, ...] = field(init=False, repr=False)
    """Names of the parameters a call may pass by position, in order."""
    defaults: dict[str, Any] = field(init=False, repr=False)
    """The default of each parameter that has one, by name."""
    refuses_by_autograd: bool = field(init=False, repr=False)
    """Whether a call may be refused by how autograd sees its array: the operator changes an
    array in place, or reduces (only sum and avg have gradients)."""

    def __post_init__(self) -> None:
        """The tables every call reads, derived from the parameters once, here (not on first
        use: torch.compile traces the validation of the static MoE operators, and cannot enter
        the lock a lazily computed attribute takes)."""
        derived = {
            "kinds": {p.name: p.kind for p in self.params},
            "signed": tuple((p.name, p.kind.sign) for p in self.params if p.kind.sign is not None),
            "readers": tuple((p.name, p.kind.read) for p in self.params if p.kind.read is not None),
            "passed_through": tuple(p.name for p in self.params if p.kind.passed_through),
            "counted": tuple(p.name for p in self.params if p.kind.holds_counts),
            "positional": tuple(p.name for p in self.params if not p.keyword_only),
            "defaults": {p.name: p.default for p in self.params if p.default is not REQUIRED},
            "refuses_by_autograd": any(p.kind.in_place or p.kind is REDUCE_OP for p in self.params),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """A call's arguments by parameter name, in the parameters' order, defaults filled in
        (what ``inspect.Signature.bind`` and ``apply_defaults`` give, at a fraction of their
        cost); None for a call that does not bind (too many arguments, an unknown or repeated
        name, a required parameter missing), which its caller hands to ``inspect`` or the
        operator for Python's TypeError."""
        if len(args) > len(self.positional):
            return None
        given = dict(zip(self.positional, args))
        for name, value in kwargs.items():  # plain loops: torch.compile traces this
            if name in given or name not in self.kinds:
                return None
            given[name] = value
        try:
            return {p.name: given[p.name] if p.name in given else self.defaults[p.name] for p in self.params}
        except KeyError:  # a required parameter not given
            return None


def rows_of(a: Any) -> int:
    """The rows of an array: its dimension 0."""
    return int(a.shape[0])


def known_total(counts: Any) -> int | None:
    """The rows that counts given as a list or tuple of non-negative ints add up to (known while
    torch.compile traces); None for counts in an array (or a list the operator will refuse)."""
    if type(counts) in (list, tuple) and all(type(v) is int and v >= 0 for v in counts):
        return sum(counts)
    return None


GROUP_PARAM = Param("group", GROUP, "Group | None", "The ranks taking part; None is the whole world.", None)
"""The ``group`` parameter every operator takes."""
