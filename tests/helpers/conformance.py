"""The conformance matrix, shared by the CPU and GPU test modules.

Cases are generated from the operator specs (``unicoll.spec.OPS``) and a backend's capability
table: every operator it provides x every array library and dtype it moves x each layout
variant of the operator, in one of the four settings of sync/async x the world group or a
sub-group (the dtypes and world sizes take them in turn: :data:`SETTINGS`). all_reduce runs every
reduction the table lists for the dtype; each reduce_scatter case draws one of them. Every case draws
random whole-world inputs from its own seed (zero counts, empty ranks, several trailing
shapes), runs on each rank of a spawned world, and is compared with ``unicoll.reference``.

Top-k dispatch and combine (``unicoll.moe``, on every backend) run as one case each: six
settings of E, k, sync/async and world/sub-group (:data:`MOE_VARIANTS`) x every library and
dtype; random expert ids with dropped slots, duplicates, tokenless ranks and now and then a
capacity; ``moe.redispatch`` of the same rows in the E = 3, k = 2 setting. The static-shape
mode (``moe.dispatch_static``, ``redispatch_static``, ``combine_static``) runs the same settings
with capacities that drop slots and capacities that do not, its padding rows filled with
values that must never be read (nan for floating dtypes).
"""

from __future__ import annotations

import traceback
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

import unicoll as uc
from unicoll import reference
from unicoll.backends.base import FLOAT_DTYPES, REDUCE_OPS, Capabilities
from unicoll.spec import OPS

#: Layout variants of each operator (an operator spec without an entry here fails the suite).
VARIANTS: dict[str, tuple[str, ...]] = {
    "global_scatter": ("one_expert", "experts"),
    "global_gather": ("one_expert", "experts"),
    "alltoall_single": ("splits", "exchange", "even", "out"),
    "alltoall": ("lists", "exchange", "arrays"),
    "all_gather": ("new", "array", "empty_list", "filled_list"),
    "all_reduce": REDUCE_OPS,
    "reduce": ("dst",),
    "reduce_scatter": ("even", "uneven", "out"),
    "broadcast": ("src",),
}

#: The top-k cases: (experts per rank, k, synchronous, on the sub-group): every E of 1 and 3 with
#: every k of 1, 2 and 4, each E both sync and async, on the world and on a sub-group.
MOE_VARIANTS = (
    (1, 1, True, False), (1, 2, False, True), (1, 4, True, True),
    (3, 1, False, True), (3, 2, False, False), (3, 4, True, False),
)  # fmt: skip

TRAILING = ((), (3,), (2, 2))

#: dtypes an array library cannot express (numpy has no bfloat16).
MISSING_DTYPES = {"numpy": {"bfloat16"}, "cupy": {"bfloat16"}, "torch": set(), "paddle": set(),
                  "jax": {"float64", "int64"}}  # fmt: skip
"""(JAX has 64-bit dtypes only with jax_enable_x64, which the matrix leaves at its default.)"""

JOINED = ("paddle", "jax")
"""The libraries that join through torch (unicoll.libraries): their arrays travel as torch
tensors, so the matrix runs their cases synchronously, on the world group and the default
stream only (those variants are torch's transfers, which the matrix covers; tests/frameworks
covers their Tasks), and one variant of each operator and dtype per world size, each variant
in turn as the world grows (:func:`_in_turn`)."""

FILLS_OUTPUTS = {"alltoall_single": ("out",), "alltoall": ("lists", "arrays"), "all_gather": ("array", "filled_list"),
                 "reduce_scatter": ("out",)}  # fmt: skip
"""The variants that pass arrays to fill, which an immutable library (JAX) cannot be."""


@dataclass(frozen=True)
class Case:
    op: str
    variant: str
    library: str
    dtype: str
    sync: bool
    subgroup: bool
    world_size: int
    stream: str | None = None  # "calc" or "comm" for use_calc_stream=True/False; None: the default
    reduction: str | None = None  # all_reduce, reduce and reduce_scatter: the op

    @property
    def id(self) -> str:
        mode = "sync" if self.sync else "async"
        where = "subgroup" if self.subgroup else "world"
        stream = f"-{self.stream}" if self.stream else ""
        variant = self.variant if self.reduction in (None, self.variant) else f"{self.variant}-{self.reduction}"
        return f"W{self.world_size}-{self.op}-{variant}-{self.library}-{self.dtype}-{mode}{stream}-{where}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


def failures(per_rank: list[dict[str, str | None]], case: Case) -> str | None:
    """Every rank's traceback where ``case`` failed, "no rank ran this case", or None (it passed)."""
    tracebacks = [o[case.id] for o in per_rank if o.get(case.id)]
    if tracebacks:
        return "\n".join(tracebacks)
    return None if any(case.id in o for o in per_rank) else "no rank ran this case"


def assert_passed(per_rank: list[dict[str, str | None]], case: Case) -> None:
    """Fail with every rank's traceback where ``case`` failed, or when no rank ran it."""
    failed = failures(per_rank, case)
    assert failed is None, failed


def assert_all_passed(per_rank: list[dict[str, str | None]], group: list[Case]) -> None:
    """:func:`assert_passed` for every case of ``group`` at once, naming each that failed: one
    test per operator of a world instead of one per case (pytest's own cost per test, 1.3 ms
    here, was a fifth of the matrix's time)."""
    failed = [f"{case.id}: {text}" for case in group if (text := failures(per_rank, case)) is not None]
    assert not failed, f"{len(failed)} of {len(group)} cases failed:\n" + "\n".join(failed)


def by_operator(matrix: list[Case]) -> dict[str, list[Case]]:
    """The cases of ``matrix`` grouped by operator (``moe`` for top-k dispatch and combine), in order."""
    groups: dict[str, list[Case]] = {}
    for case in matrix:
        groups.setdefault(case.op, []).append(case)
    return groups


def subgroup_ranks(world_size: int) -> list[int]:
    """World ranks of the matrix's sub-group: all but rank 0, so positions differ from ranks."""
    return list(range(1, world_size)) or [0]


def cases(caps: Capabilities, world_size: int, streams: tuple[str | None, ...] = (None,)) -> list[Case]:
    """Every case of the matrix for a backend with capability table ``caps``; synchronous
    calls once per entry of ``streams`` (asynchronous ones always use the communication stream)."""
    operators = [
        Case(op, variant, library, dtype, sync, subgroup, world_size, stream, reduction)
        for op in OPS
        if caps.provides(op)
        for variant in VARIANTS[op]
        for library in sorted(caps.libraries)
        if not (library == "jax" and variant in FILLS_OUTPUTS.get(op, ()))
        for dtype in sorted(caps.dtypes - MISSING_DTYPES[library])
        if library not in JOINED or _in_turn(variant, _runnable(caps, op, library, dtype), dtype, world_size)
        for sync, subgroup in _settings(caps, op, variant, library, dtype, world_size)
        for stream in (streams if sync and library not in JOINED else (None,))
        if (reduction := _reduction(caps, op, variant, dtype, (library, sync, stream, subgroup))) != ""
    ]
    topk = [
        Case(op, f"E{experts}-k{k}", library, dtype, sync, subgroup, world_size)
        for experts, k, sync, subgroup in MOE_VARIANTS
        for op in ("moe", "moe_static")
        for library in sorted(caps.libraries)
        if library not in JOINED or (sync and not subgroup)
        for dtype in sorted(caps.dtypes - MISSING_DTYPES[library])
        if library not in JOINED or _in_turn(f"E{experts}-k{k}", JOINED_MOE_VARIANTS, dtype, world_size)
    ]
    return operators + topk


SETTINGS = ((True, False), (False, True), (False, False), (True, True))
"""The (synchronous, on a sub-group) settings of a numpy, torch or cupy case; each case runs
one (:func:`_settings`). The dtypes that run an operator's variant on a library take them in
turn, and the world size moves each dtype on by one, so every operator, variant and library
runs every setting on every world size (by some dtypes, where it runs at least four) and each
dtype runs a different setting on each world size (all four over the worlds of 1 to 4 ranks):
whether a call is synchronous and which group it runs on does not depend on the dtype, and
each further setting per case would cost the matrix as much again."""


def _settings(
    caps: Capabilities, op: str, variant: str, library: str, dtype: str, world_size: int
) -> list[tuple[bool, bool]]:
    """The settings a case of ``op``'s ``variant`` on ``library``'s arrays of ``dtype`` runs on
    ``world_size`` ranks: for numpy, torch and cupy one of :data:`SETTINGS`, by the dtype's
    place among those the variant runs on (:func:`_runnable`), moved on by the world size; none
    where the variant does not run on the dtype; the joined libraries' cases run synchronously
    on the world."""
    if library in JOINED:
        return [(True, False)]
    dtypes = [d for d in sorted(caps.dtypes - MISSING_DTYPES[library]) if variant in _runnable(caps, op, library, d)]
    return [SETTINGS[(dtypes.index(dtype) + world_size) % len(SETTINGS)]] if dtype in dtypes else []


JOINED_MOE_VARIANTS = tuple(f"E{e}-k{k}" for e, k, sync, subgroup in MOE_VARIANTS if sync and not subgroup)


def _runnable(caps: Capabilities, op: str, library: str, dtype: str) -> tuple[str, ...]:
    """The variants of ``op`` that run on ``library``'s arrays of ``dtype`` (JAX's cannot be
    filled; a reduction must be one the backend has for the dtype)."""
    return tuple(
        v for v in VARIANTS[op]
        if not (library == "jax" and v in FILLS_OUTPUTS.get(op, ())) and _reduction(caps, op, v, dtype, ()) != ""
    )  # fmt: skip


def _in_turn(variant: str, variants: tuple[str, ...], dtype: str, world_size: int) -> bool:
    """Whether ``variant`` is the one of ``variants`` a joined library runs for ``dtype`` in a
    world of ``world_size``: the dtypes start at different variants and the world size moves
    each on by one, so every variant runs with some dtype over the worlds that run the library
    (tests/system/test_conformance.py checks nothing is left out)."""
    start = zlib.crc32(dtype.encode())
    return variants[(start + world_size) % len(variants)] == variant


def _reduction(caps: Capabilities, op: str, variant: str, dtype: str, salt: tuple) -> str | None:
    """The reduction of an all_reduce, reduce or reduce_scatter case (one the table lists for the
    dtype; for reduce and reduce_scatter drawn from them by the case's other fields), None for
    the other operators, and "" for a case the backend does not run."""
    ops = [name for name in REDUCE_OPS if dtype in caps.reductions.get(name, ())]
    if op == "all_reduce":
        return variant if variant in ops else ""
    if op in ("reduce_scatter", "reduce"):
        return ops[zlib.crc32(repr((variant, dtype, *salt)).encode()) % len(ops)] if ops else ""
    return None


# -- inputs and expected outputs -------------------------------------------------------------


def _values(rng: np.random.Generator, rows: int, trailing: tuple[int, ...], dtype: str, high: int = 100) -> np.ndarray:
    shape = (rows, *trailing)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    # small integers are exact in every dtype, bfloat16 included
    return rng.integers(0, high, shape).astype("float32" if dtype == "bfloat16" else dtype)


def _reduced_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, op: str, world: int) -> np.ndarray:
    """Values whose reduction over ``world`` ranks is exact in every dtype (bfloat16 holds the
    integers up to 256): products of 0..3, sums of 0..15, averages of multiples of ``world``."""
    values = _values(rng, shape[0], shape[1:], dtype, 4 if op == "prod" else 16)
    if op in ("max", "min") and dtype in FLOAT_DTYPES:  # NaN and signed zeros, whose answer once depended on the rank
        special = rng.integers(0, 8, values.shape)
        values = np.where(special == 0, np.nan, np.where(special == 1, -0.0, np.where(special == 2, 0.0, values)))
    return values * world if op == "avg" else values


def _reduction_case(case: Case, world: int, rng: np.random.Generator, trailing: tuple[int, ...]) -> dict[str, Any]:
    op = case.reduction
    if case.op == "all_reduce":
        xs = [_reduced_values(rng, (int(rng.integers(0, 4)), *trailing), case.dtype, op, world)]
        xs += [_reduced_values(rng, xs[0].shape, case.dtype, op, world) for _ in range(world - 1)]
        return dict(args=[dict(x=x) for x in xs], expected=reference.all_reduce(xs, op))
    if case.op == "reduce":  # dst: a position here, the group's rank there (_call)
        dst = int(rng.integers(world))
        xs = [_reduced_values(rng, (int(rng.integers(0, 4)), *trailing), case.dtype, op, world)]
        xs += [_reduced_values(rng, xs[0].shape, case.dtype, op, world) for _ in range(world - 1)]
        return dict(args=[dict(x=x, dst=dst) for x in xs], expected=reference.reduce(xs, dst, op))
    even = case.variant == "even"
    splits = np.full(world, int(rng.integers(0, 3))) if even else rng.integers(0, 4, world)
    xs = [_reduced_values(rng, (int(splits.sum()), *trailing), case.dtype, op, world) for _ in range(world)]
    expected = reference.reduce_scatter(xs, op, None if even else splits)
    return dict(args=[dict(x=x, splits=splits) for x in xs], expected=expected)


def _counts(rng: np.random.Generator, world: int, experts: int) -> np.ndarray:
    """Per-rank local counts with zeros, and now and then a rank that sends nothing."""
    counts = rng.integers(0, 4, (world, world * experts)) * (rng.random((world, world * experts)) > 0.3)
    if world > 1 and rng.random() < 0.25:
        counts[rng.integers(world)] = 0
    return counts.astype(np.int64)


FLOATING = ("float16", "bfloat16", "float32", "float64")


class _Routing(NamedTuple):
    """One top-k case's whole-world routing: experts per rank, k, the dtype values are made in,
    each rank's tokens and expert ids."""

    experts: int
    k: int
    wide: str
    tokens: list[int]
    ids: list[np.ndarray]


def _routing(case: Case, world: int, rng: np.random.Generator) -> _Routing:
    """A few tokens per rank (some ranks have none), about a fifth of the slots dropped."""
    experts, k = (int(part[1:]) for part in case.variant.split("-"))
    wide = "float32" if case.dtype == "bfloat16" else case.dtype
    tokens = [int(rng.integers(0, 6)) * (rng.random() > 0.15) for _ in range(world)]
    ids = [np.where(rng.random((t, k)) < 0.2, -1, rng.integers(0, world * experts, (t, k))) for t in tokens]
    return _Routing(experts, k, wide, tokens, ids)


def _tokens(case: Case, r: _Routing, rng: np.random.Generator, trailing: tuple[int, ...]) -> list[np.ndarray]:
    """Each rank's tokens: small values, so every sum is exact, bfloat16 too."""
    high = 2 if case.dtype == "bool" else 8
    return [rng.integers(0, high, (t, *trailing)).astype(r.wide) for t in r.tokens]


def _with_combine(
    case: Case, r: _Routing, rng: np.random.Generator, ys: list[np.ndarray], combine: Any, inputs: dict[str, Any]
) -> dict[str, Any]:
    """``inputs`` (args and expected per rank) with a combine of ``ys`` added, weighted for
    floating dtypes: ``combine(ys, weights)`` is the reference's."""
    weights = (
        [rng.choice([0.5, 1.0, 2.0], (t, r.k)).astype(r.wide) for t in r.tokens] if case.dtype in FLOATING else None
    )
    combined = combine(ys, weights)
    for position, (args, expected) in enumerate(zip(inputs["args"], inputs["expected"])):
        args.update(y=ys[position], topk_weights=None if weights is None else weights[position])
        expected["combined"] = combined[position]
    return inputs


def _moe_case(case: Case, world: int, rng: np.random.Generator, trailing: tuple[int, ...]) -> dict[str, Any]:
    """Top-k routing (:func:`_routing`) and now and then a capacity; dispatch's rows and, but
    for bool, a combine of outputs that differ from them (weighted for floating dtypes)."""
    r = _routing(case, world, rng)
    capacity = int(rng.integers(0, 3)) if rng.random() < 0.3 else None
    xs = _tokens(case, r, rng, trailing)
    rows, per_expert = reference.moe_dispatch(xs, r.ids, r.experts, capacity)
    inputs = dict(
        args=[dict(x=xs[c], topk_idx=r.ids[c], experts_per_rank=r.experts, capacity=capacity) for c in range(world)],
        expected=[dict(rows=rows[c], rows_per_expert=per_expert[c]) for c in range(world)],
    )
    if case.dtype == "bool":
        return inputs
    ys = [(rw + np.arange(len(rw)).reshape(-1, *(1,) * len(trailing)) % 4).astype(r.wide) for rw in rows]
    combine = lambda ys, weights: reference.moe_combine(ys, r.ids, r.experts, weights, capacity)  # noqa: E731
    return _with_combine(case, r, rng, ys, combine, inputs)


def _moe_static_case(case: Case, world: int, rng: np.random.Generator, trailing: tuple[int, ...]) -> dict[str, Any]:
    """The static-shape mode on :func:`_moe_case`'s kind of routing, with a capacity from 0 to 3
    (which drops slots) half the time and 8 (which does not) the other half; the outputs'
    padding rows hold values nothing may read."""
    r = _routing(case, world, rng)
    capacity = int(rng.integers(0, 4)) if rng.random() < 0.5 else 8
    xs = _tokens(case, r, rng, trailing)
    rows, counts, demand = reference.moe_dispatch_static(xs, r.ids, r.experts, capacity)
    inputs = dict(
        args=[dict(x=xs[c], topk_idx=r.ids[c], experts_per_rank=r.experts, capacity=capacity) for c in range(world)],
        expected=[dict(rows=rows[c], counts=counts[c], demand=demand[c]) for c in range(world)],
    )
    if case.dtype == "bool":
        return inputs
    unread = np.nan if case.dtype in FLOATING else 99
    ys = []
    for c in range(world):
        y = (rows[c] + 1).astype(np.float64)
        slot = np.arange(world * capacity) % max(capacity, 1)
        y[slot[None, :] >= np.repeat(counts[c], capacity, axis=1)] = unread
        ys.append(y.astype(r.wide))
    combine = lambda ys, weights: reference.moe_combine_static(ys, r.ids, r.experts, capacity, weights)  # noqa: E731
    return _with_combine(case, r, rng, ys, combine, inputs)


def world_case(case: Case, world: int) -> dict[str, Any]:
    """Whole-world inputs (``args``: one dict per group position) and ``expected`` outputs."""
    rng = np.random.default_rng(case.seed)
    trailing = TRAILING[rng.integers(len(TRAILING))]
    if case.op == "moe":
        return _moe_case(case, world, rng, trailing)
    if case.op == "moe_static":
        return _moe_static_case(case, world, rng, trailing)
    if case.reduction is not None:
        return _reduction_case(case, world, rng, trailing)
    if case.op == "broadcast":
        src, rows = int(rng.integers(world)), int(rng.integers(0, 4))
        xs = [_values(rng, rows, trailing, case.dtype) for _ in range(world)]
        return dict(args=[dict(x=x, src=src) for x in xs], expected=reference.broadcast(xs, src))
    if case.op in ("global_scatter", "global_gather"):
        experts = 1 if case.variant == "one_expert" else int(rng.integers(2, 4))
        local = _counts(rng, world, experts)
        glob = reference.global_counts(list(local))
        sent = local if case.op == "global_scatter" else np.stack(glob)
        xs = [_values(rng, int(c.sum()), trailing, case.dtype) for c in sent]
        fn = reference.global_scatter if case.op == "global_scatter" else reference.global_gather
        expected = fn([x.astype("float32") if case.dtype == "bfloat16" else x for x in xs], list(local))
        args = [dict(x=xs[r], local_count=local[r], global_count=glob[r]) for r in range(world)]
        return dict(args=args, expected=expected)
    if case.op == "alltoall_single":
        if case.variant == "even":
            per = int(rng.integers(0, 3))
            splits = np.full((world, world), per, dtype=np.int64)
        else:
            splits = _counts(rng, world, 1)
        xs = [_values(rng, int(s.sum()), trailing, case.dtype) for s in splits]
        expected = reference.alltoall_single(xs, list(splits))
        args = [dict(x=xs[r], in_splits=splits[r], out_splits=splits[:, r]) for r in range(world)]
        return dict(args=args, expected=expected)
    if case.op == "alltoall":  # rows[r, c]: what rank r sends rank c
        rows = np.full((world, world), rng.integers(0, 3)) if case.variant == "arrays" else _counts(rng, world, 1)
        parts = [[_values(rng, int(rows[r, c]), trailing, case.dtype) for c in range(world)] for r in range(world)]
        expected = [np.concatenate(received) for received in reference.alltoall(parts)]
        args = [dict(x=np.concatenate(parts[r]), sent=rows[r].tolist(), rows=rows[:, r].tolist()) for r in range(world)]
        return dict(args=args, expected=expected)
    rows = [int(rng.integers(0, 4))] * world if case.variant == "array" else rng.integers(0, 4, world).tolist()
    xs = [_values(rng, n, trailing, case.dtype) for n in rows]
    return dict(args=[dict(x=x, rows=rows) for x in xs], expected=reference.all_gather(xs))


# -- running a case on one rank --------------------------------------------------------------


def to_library(a: np.ndarray, library: str, dtype: str, device: str) -> Any:
    """``a`` as an array of ``library`` (on ``device``) with dtype ``dtype``."""
    if library == "numpy":
        return a.copy()
    if library == "torch":
        import torch

        return torch.from_numpy(a.copy()).to(device=device, dtype=getattr(torch, dtype))
    if library == "paddle":
        import paddle

        return paddle.to_tensor(a.astype(np.float32) if dtype == "bfloat16" else a.copy()).astype(dtype)
    if library == "jax":
        import jax

        # cast by numpy (ml_dtypes has bfloat16) and placed: jnp.asarray compiles once per shape
        return jax.device_put(a.astype(jax.dtypes.canonicalize_dtype(dtype)))
    import cupy

    return cupy.asarray(a)


def to_numpy(a: Any) -> np.ndarray:
    """Any library's array as numpy (bfloat16 widened to float32)."""
    module = type(a).__module__.split(".")[0]
    if module == "torch":
        import torch

        return (a.float() if a.dtype == torch.bfloat16 else a).detach().cpu().numpy()
    if module == "cupy":
        return a.get()
    if module == "paddle":
        return (a.astype("float32") if str(a.dtype) == "paddle.bfloat16" else a).numpy()
    if module in ("jax", "jaxlib"):
        return np.asarray(a).astype(np.float32 if a.dtype.name == "bfloat16" else a.dtype)
    return np.asarray(a)


def _empty(like: Any, rows: int) -> Any:
    from array_api_compat import array_namespace, device

    if type(like).__module__.split(".")[0] == "paddle":
        import paddle

        return paddle.zeros([rows, *like.shape[1:]], dtype=like.dtype)
    xp = array_namespace(like)
    return xp.zeros((rows, *like.shape[1:]), dtype=like.dtype, device=device(like))


def _call(case: Case, a: dict[str, Any], group: uc.Group, device: str) -> tuple[Any, Any]:
    """Run the case's operator; returns (result, the in-place target or None)."""
    if case.op == "moe":
        return _moe_call(case, a, group, device), None
    if case.op == "moe_static":
        return _moe_static_call(case, a, group, device), None
    kw = dict(group=group) if case.sync else dict(group=group, sync_op=False, use_calc_stream=False)
    if case.stream is not None:
        kw["use_calc_stream"] = case.stream == "calc"
    x = to_library(a["x"], case.library, case.dtype, device)
    if case.op == "global_scatter":
        return uc.global_scatter(x, a["local_count"], a["global_count"], **kw), None
    if case.op == "global_gather":
        return uc.global_gather(x, a["local_count"], a["global_count"], **kw), None
    if case.op == "alltoall_single":
        if case.variant == "splits":
            return uc.alltoall_single(None, x, a["out_splits"], a["in_splits"], **kw), None
        if case.variant == "exchange":
            return uc.alltoall_single(None, x, in_split_sizes=a["in_splits"], **kw), None
        if case.variant == "even":
            return uc.alltoall_single(None, x, **kw), None
        out = _empty(x, int(a["out_splits"].sum()))
        return uc.alltoall_single(out, x, a["out_splits"], a["in_splits"], **kw), out
    if case.op == "alltoall":
        if case.variant == "arrays":
            out = _empty(x, int(sum(a["rows"])))
            return uc.alltoall(out, x, **kw), out
        offsets = np.cumsum([0, *a["sent"]])
        parts = [x[offsets[c] : offsets[c + 1]] for c in range(len(a["sent"]))]
        target = [] if case.variant == "exchange" else [_empty(x, n) for n in a["rows"]]
        return uc.alltoall(target, parts, **kw), target
    in_place = None if case.library == "jax" else x  # JAX's arrays are immutable: a new one comes back
    if case.op == "all_reduce":
        return uc.all_reduce(x, case.reduction, **kw), in_place
    if case.op == "broadcast":
        return uc.broadcast(x, a["src"], **kw), in_place
    if case.op == "reduce":  # Paddle's dst is a global rank
        dst = a["dst"] if group is None else group.ranks[a["dst"]]
        return uc.reduce(x, dst, case.reduction, **kw), in_place
    if case.op == "reduce_scatter":
        if case.variant == "even":
            return uc.reduce_scatter(None, x, case.reduction, **kw), None
        if case.variant == "uneven":
            return uc.reduce_scatter(None, x, case.reduction, a["splits"], **kw), None
        out = _empty(x, int(a["splits"][group.rank if group is not None else uc.get_rank()]))
        return uc.reduce_scatter(out, x, case.reduction, a["splits"], **kw), out
    if case.variant == "new":
        return uc.all_gather(None, x, **kw), None
    if case.variant == "array":
        out = _empty(x, int(sum(a["rows"])))
        return uc.all_gather(out, x, **kw), out
    target = [] if case.variant == "empty_list" else [_empty(x, n) for n in a["rows"]]
    return uc.all_gather(target, x, **kw), target


def _moe_inputs(case: Case, a: dict[str, Any], device: str) -> tuple[Any, Any, Any]:
    """A top-k case's tokens, expert ids and weights (or None) in the case's library."""
    weights = a.get("topk_weights")
    return (
        to_library(a["x"], case.library, case.dtype, device),
        to_library(a["topk_idx"], case.library, "int64", device),
        None if weights is None else to_library(weights, case.library, case.dtype, device),
    )


def _moe_call(case: Case, a: dict[str, Any], group: uc.Group, device: str) -> dict[str, Any]:
    """dispatch, redispatch of the same rows (E3-k2), then (but for bool) combine; each waited
    for when asynchronous."""
    x, ids, weights = _moe_inputs(case, a, device)
    kw = dict(group=group, sync_op=case.sync, capacity=a["capacity"])
    dispatched = uc.moe.dispatch(x, ids, weights, experts_per_rank=a["experts_per_rank"], **kw)
    rows, rows_per_expert, handle = dispatched if case.sync else _waited(dispatched)
    result = dict(rows=rows, rows_per_expert=rows_per_expert)
    if case.variant == "E3-k2":  # the same rows again along the handle, with no count exchange
        again = uc.moe.redispatch(x, handle, sync_op=case.sync)
        result["again"] = again if case.sync else _waited(again)
    if "y" in a:
        combined = uc.moe.combine(to_library(a["y"], case.library, case.dtype, device), handle, sync_op=case.sync)
        result["combined"] = combined if case.sync else _waited(combined)
    return result


def _moe_static_call(case: Case, a: dict[str, Any], group: uc.Group, device: str) -> dict[str, Any]:
    """dispatch_static, redispatch_static of the same rows (E3-k2), then (but for bool)
    combine_static; each waited for when asynchronous."""
    x, ids, weights = _moe_inputs(case, a, device)
    kw = dict(group=group, sync_op=case.sync, capacity=a["capacity"])
    dispatched = uc.moe.dispatch_static(x, ids, weights, experts_per_rank=a["experts_per_rank"], **kw)
    rows, counts, handle = dispatched if case.sync else _waited(dispatched)
    result = dict(rows=rows, counts=counts, demand=handle.received_before_drop)
    if case.variant == "E3-k2":
        again = uc.moe.redispatch_static(x, handle, sync_op=case.sync)
        result["again"] = again if case.sync else _waited(again)
    if "y" in a:
        y = to_library(a["y"], case.library, case.dtype, device)
        combined = uc.moe.combine_static(y, handle, sync_op=case.sync)
        result["combined"] = combined if case.sync else _waited(combined)
    return result


def _waited(task: Any) -> Any:
    assert isinstance(task, uc.Task), f"sync_op=False returned {type(task).__name__}"
    return task.wait()


def _check(case: Case, a: dict[str, Any], result: Any, target: Any, expected: Any) -> None:
    if case.op == "moe_static":
        from unicoll.arrays import library_of

        for name in ("counts", "demand"):
            assert library_of(result[name]) == case.library, f"{name} in {library_of(result[name])}"
            np.testing.assert_array_equal(to_numpy(result[name]), expected[name], err_msg=name)
        _check_array(result["rows"], expected["rows"], case)
        if "again" in result:
            _check_array(result["again"], expected["rows"], case)
        if "combined" in expected:
            _check_array(result["combined"], expected["combined"], case)
        return
    if case.op == "moe":
        assert result["rows_per_expert"] == expected["rows_per_expert"], (
            f"rows_per_expert {result['rows_per_expert']}, expected {expected['rows_per_expert']}"
        )
        assert all(type(n) is int for n in result["rows_per_expert"]), "rows_per_expert must be host ints"
        _check_array(result["rows"], expected["rows"], case)
        if "again" in result:
            _check_array(result["again"], expected["rows"], case)
        if "combined" in expected:
            _check_array(result["combined"], expected["combined"], case)
        return
    if target is not None:
        assert result is target, "the in-place form must return its target"
    if not isinstance(result, list):
        _check_array(result, expected, case)
        return
    assert len(result) == len(a["rows"]), f"a list of {len(result)} arrays for {len(a['rows'])} ranks"
    offsets = np.cumsum([0, *a["rows"]])
    for c, got in enumerate(result):
        _check_array(got, expected[offsets[c] : offsets[c + 1]], case)


def _check_array(got: Any, want: np.ndarray, case: Case) -> None:
    from unicoll.arrays import dtype_name, library_of

    assert library_of(got) == case.library, f"library {library_of(got)}, expected {case.library}"
    assert dtype_name(got) == case.dtype, f"dtype {dtype_name(got)}, expected {case.dtype}"
    values = to_numpy(got)
    assert values.shape == want.shape, f"shape {values.shape}, expected {want.shape}"
    np.testing.assert_array_equal(values, want)
    if values.dtype.kind == "f":
        np.testing.assert_array_equal(
            np.signbit(values), np.signbit(want), err_msg="the signs differ (of zeros or NaN)"
        )


def run_cases(rank: int, all_cases: list[Case], device: str = "cpu") -> dict[str, str | None]:
    """Run every case on this rank; returns each case's failure text (None when it passed)."""
    world = uc.get_world_size()
    sub = uc.new_group(subgroup_ranks(world))
    outcome: dict[str, str | None] = {}
    for case in all_cases:
        group = sub if case.subgroup else None
        if case.subgroup and not sub.is_member:
            continue
        size = sub.world_size if case.subgroup else world
        position = sub.rank if case.subgroup else rank
        inputs = world_case(case, size)
        a = inputs["args"][position]
        try:
            result, target = _call(case, a, group, device)
            if not case.sync and case.op not in ("moe", "moe_static"):
                assert isinstance(result, uc.Task), f"sync_op=False returned {type(result).__name__}"
                result = result.wait()
            _check(case, a, result, target, inputs["expected"][position])
            outcome[case.id] = None
        except Exception:
            outcome[case.id] = f"rank {rank}:\n{traceback.format_exc()}"
    return outcome
