"""The public API is pinned: an accidental change to a name or a signature fails here."""

from __future__ import annotations

import importlib.util
import inspect
import operator
import subprocess
import sys
from pathlib import Path

import unicoll as uc
from unicoll import check, kinds
from unicoll.spec import OPS, REQUIRED, SPECS, Call

PUBLIC = {
    "BackendUnavailableError": None,
    "CollectiveTimeoutError": None,
    "CommunicationError": None,
    "CrossRankMismatchError": None,
    "IntegrityError": None,
    "PeerLostError": None,
    "Group": None,
    "NotInitializedError": None,
    "Task": None,
    "__version__": None,
    "reference": None,
    "moe": None,
    "testing": None,
    "init": "(backend=None, *, timeout=None, check=None, handshake=None, verify=None)",
    "finalize": "()",
    "is_initialized": "()",
    "get_rank": "(group=None)",
    "get_world_size": "(group=None)",
    "get_backend": "()",
    "new_group": "(ranks)",
    "barrier": "(group=None)",
    "register_backend": "(name, factory)",
    "exchange_counts": "(local_count, group=None)",
    "global_scatter": "(x, local_count, global_count, group=None, sync_op=True, use_calc_stream=True)",
    "global_gather": "(x, local_count, global_count, group=None, sync_op=True, use_calc_stream=True)",
    "alltoall_single": "(out_tensor, in_tensor, out_split_sizes=None, in_split_sizes=None, group=None, "
    "sync_op=True, use_calc_stream=False)",
    "alltoall": "(out_tensor_or_tensor_list, in_tensor_or_tensor_list, group=None, sync_op=True, use_calc_stream=False)",
    "all_gather": "(tensor_or_tensor_list, tensor, group=None, sync_op=True, use_calc_stream=False)",
    "all_reduce": "(tensor, op='sum', group=None, sync_op=True, use_calc_stream=False)",
    "reduce_scatter": "(out, tensor, op='sum', split_sizes=None, group=None, sync_op=True, use_calc_stream=False)",
    "broadcast": "(tensor, src, group=None, sync_op=True, use_calc_stream=False)",
    "reduce": "(tensor, dst, op='sum', group=None, sync_op=True, use_calc_stream=False)",
}

TESTING = {"spawn": "(fn, world_size, *args, backend=None, timeout=120, env=None, start_method=None)"}
TASK = {"wait": "(self, timeout=None)", "is_completed": "(self)"}
MOE = {
    "dispatch": "(x, topk_idx, topk_weights=None, *, experts_per_rank, group=None, sync_op=True, capacity=None)",
    "redispatch": "(x, handle, *, sync_op=True)",
    "combine": "(y, handle, *, sync_op=True)",
    "dispatch_static": "(x, topk_idx, topk_weights=None, *, experts_per_rank, capacity, group=None, sync_op=True, "
    "overflow='drop', max_tokens_per_rank=None)",
    "redispatch_static": "(x, handle, *, sync_op=True)",
    "combine_static": "(y, handle, *, sync_op=True)",
    "jit_errors": "()",
}


def bare(fn) -> str:
    """A signature without annotations: names, kinds and defaults only."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]
    return str(inspect.Signature(params))


def test_all_lists_exactly_the_public_names() -> None:
    assert sorted(uc.__all__) == sorted(PUBLIC)
    for name in uc.__all__:
        assert hasattr(uc, name), name


def test_public_signatures_are_pinned() -> None:
    for name, expected in PUBLIC.items():
        if expected is not None:
            assert bare(getattr(uc, name)) == expected, name
    for name, expected in TESTING.items():
        assert bare(getattr(uc.testing, name)) == expected, name
    for name, expected in TASK.items():
        assert bare(getattr(uc.Task, name)) == expected, name
    for name, expected in MOE.items():
        assert bare(getattr(uc.moe, name)) == expected, name
    assert sorted(uc.moe.__all__) == ["Handle", "StaticHandle", *sorted(MOE)]
    group = uc.Group((0, 2), handle=None, world_rank=2, session=0)
    assert (group.ranks, group.rank, group.world_size) == ((0, 2), 1, 2)


def test_specs_describe_the_functions() -> None:
    """Each entry point's spec lists exactly the function's parameters and defaults."""
    for name, op in SPECS.items():
        params = inspect.signature(operator.attrgetter(name)(uc)).parameters
        assert [p.name for p in op.params] == list(params), name
        for p in op.params:
            assert p.keyword_only == (params[p.name].kind is inspect.Parameter.KEYWORD_ONLY), (name, p.name)
            default = params[p.name].default
            assert (default is inspect.Parameter.empty) == (p.default is REQUIRED), (name, p.name)
            if p.default is not REQUIRED:
                assert default == p.default, (name, p.name)


def test_data_operators_are_the_specs_in_capability_tables() -> None:
    """OPS (what capability tables and the conformance matrix list) holds the data operators;
    SPECS holds every entry point with a spec, exchange_counts included."""
    assert all(SPECS[name] is op and op.in_capabilities for name, op in OPS.items())
    assert [name for name in SPECS if name not in OPS] == [
        "exchange_counts",
        "moe.dispatch",
        "moe.redispatch",
        "moe.combine",
        "moe.dispatch_static",
        "moe.redispatch_static",
        "moe.combine_static",
    ]


def test_every_spec_has_kinds_and_a_check_mode_comparison() -> None:
    """Each spec's parameters have kinds; check mode compares its calls by a comparison of its
    own, of the spec it is checked as, or of the parameters it says every rank passes alike
    (among them one array, whose rows are compared)."""
    for op in SPECS.values():
        assert all(isinstance(p.kind, kinds.Kind) for p in op.params), op.name
        assert op.checked_as is None or op.checked_as in check.CHECKS, op.name
        if op not in check.CHECKS and op.checked_as is None:
            assert set(op.agree) <= op.kinds.keys(), op.name
            assert [name for name in op.agree if op.kinds[name].passed_through], op.name
    assert check.ENTRY_POINTS == (*SPECS, *(f"{name} (backward)" for name in SPECS), "barrier", "new_group")


def test_every_gradient_is_said_once() -> None:
    """An operator's gradient is its backward function (unicoll.eager.ops.<name>_backward, whose
    docstring the API page shows) or, for one without, the spec's words: never both."""
    from unicoll.eager import ops as eager_ops

    for name, op in SPECS.items():
        own = getattr(eager_ops, f"{name.replace('.', '_')}_backward", None)
        assert (own is None) == bool(op.backward), name
        assert own is None or own.__doc__, name


def test_call_copy_keeps_every_field() -> None:
    common = {name: object() for name in ("W", "group", "backend", "timeout", "compare", "check")}
    params = {p.name: object() for spec in SPECS.values() for p in spec.params if p.name not in common}
    call = Call(**common, **params)
    call.plan = object()
    copied = call.copy()
    fields = {name: getattr(copied, name) for name in Call.__slots__}
    assert copied is not call and fields == {**common, **params, "plan": call.plan}


def test_api_page_is_generated_from_the_specs() -> None:
    root = Path(__file__).resolve().parents[2]
    loader = importlib.util.spec_from_file_location("docgen", root / "tools" / "docgen.py")
    docgen = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(docgen)
    page = root / "docs" / "api.md"
    assert page.read_text(encoding="utf-8") == docgen.render(), "run: python tools/docgen.py docs/api.md"


def test_import_loads_no_framework() -> None:
    """Nor unicoll.nn's torch.nn layer, nor unicoll.paddle_moe's route, nor transformers or Paddle."""
    frameworks = "('torch', 'cupy', 'transformers', 'paddle')"
    ours = "('unicoll.nn', 'unicoll.paddle_moe')"
    code = (
        f"import sys, unicoll; print(sorted(m for m in sys.modules if m.split('.')[0] in {frameworks} or m in {ours}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_import_starts_no_process_machinery() -> None:
    """``uc.testing`` (multiprocessing, subprocess, socket) loads on first use, not with
    ``import unicoll``; nor does importlib.metadata (which loads socket) until the version or
    the registry's entry points are asked for."""
    code = (
        "import sys, unicoll; "
        "print(sorted(m for m in ('multiprocessing', 'subprocess', 'socket', 'importlib.metadata') if m in sys.modules)); "
        "unicoll.testing.spawn; print('multiprocessing' in sys.modules); print(unicoll.__version__ != '')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True", "True"]
