"""What the GPU backends do on the host, checked on a machine without CUDA: their probes and
init errors, their capability tables' errors for arrays they cannot move, and torch-nccl's
stream routing, run over gloo."""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest
import torch

import unicoll as uc
from helpers.conformance import cases, run_cases
from helpers.gpu_backends import start_on_gloo
from unicoll import registry
from unicoll.backends.base import Capabilities, reductions
from unicoll.backends.cupy import nccl as cupy_nccl
from unicoll.backends.torch import nccl as torch_nccl
from unicoll.backends.torch.transport import TorchDistBackend, TorchNcclBackend, issue_on_stream

without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


pytestmark = pytest.mark.usefixtures("clean_env")


# -- probes and init -------------------------------------------------------------------------


@without_cuda
@pytest.mark.parametrize("name", ["torch-nccl", "cupy-nccl"])
def test_init_without_cuda_says_so(name, monkeypatch) -> None:
    reason = registry.registered()[name].probe()  # cupy-nccl without cupy: says that first
    assert "no CUDA device" in reason or reason.startswith("the package cupy-cuda"), reason  # test_cuda_packages: which
    monkeypatch.setenv("UNICOLL_BACKEND", name)
    with pytest.raises(
        uc.BackendUnavailableError,
        match=rf"\$UNICOLL_BACKEND: backend '{name}' is not usable here: {re.escape(reason)}; usable here: gloo",
    ):
        uc.init()
    with pytest.raises(
        uc.BackendUnavailableError, match=rf"init\(backend=...\): backend '{name}' .*{re.escape(reason)}"
    ):
        uc.init(name)
    assert not uc.is_initialized()


@without_cuda
def test_torch_nccl_probe_reasons(monkeypatch) -> None:
    probe = torch_nccl.TorchNcclFactory().probe
    assert "no CUDA device is visible to torch" in probe()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert probe() == "this torch build has no NCCL support"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert probe() == "2 ranks on this machine ($LOCAL_WORLD_SIZE) but 1 CUDA device(s); NCCL needs one per rank"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert probe() is None


def _fake_cupy(monkeypatch, version: str, devices, nccl_available: bool) -> None:
    """A stand-in ``cupy`` module with the attributes the probe reads."""

    def count() -> int:
        if isinstance(devices, Exception):
            raise devices
        return devices

    fake = types.ModuleType("cupy")
    fake.__version__ = version
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available
    fake_cuda = types.ModuleType("cupy.cuda")
    fake_cuda.runtime = fake.cuda.runtime
    fake_cuda.nccl = nccl
    fake.cuda = fake_cuda
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)


def test_cupy_nccl_probe_reasons(monkeypatch) -> None:
    probe = cupy_nccl.CupyNcclFactory().probe
    _fake_cupy(monkeypatch, "13.6.0", 1, True)
    assert probe() == "cupy 13.6.0 is too old: cupy-nccl needs cupy 14 or later"
    _fake_cupy(monkeypatch, "14.0.0", RuntimeError("cudaErrorNoDevice"), True)
    assert probe() == "no CUDA device is usable (RuntimeError: cudaErrorNoDevice)"
    _fake_cupy(monkeypatch, "14.0.0", 0, True)
    assert probe() == "no CUDA device is visible"
    _fake_cupy(monkeypatch, "14.0.0", 1, False)
    assert probe().startswith("cupy cannot load the NCCL library: the package nvidia-nccl-cu")  # test_cuda_packages
    _fake_cupy(monkeypatch, "14.0.0", 1, True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert "4 ranks on this machine" in probe()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert probe() is None


def test_cupy_nccl_probe_without_cupy(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert cupy_nccl.CupyNcclFactory().probe().startswith("the package cupy-cuda")  # which: test_cuda_packages


def test_cupy_nccl_imports_no_torch_and_no_cupy_until_it_starts() -> None:
    import subprocess

    code = (
        "import sys, unicoll\n"
        "from unicoll.backends import rendezvous\nfrom unicoll.backends.cupy import nccl, schedule\nfrom unicoll.backends.torch import errors\n"
        "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- capability tables -----------------------------------------------------------------------


def _start_with_table(name: str, table: Capabilities) -> None:
    """Start gloo under ``name`` wearing a GPU backend's capability table (validation only)."""
    start_on_gloo(name + "-table", TorchDistBackend, name, table)


@pytest.mark.parametrize(
    ("name", "table"), [("torch-nccl", torch_nccl.CAPABILITIES), ("cupy-nccl", cupy_nccl.CAPABILITIES)]
)
def test_cpu_arrays_are_refused_not_copied(name, table) -> None:
    try:
        _start_with_table(name, table)
        with pytest.raises(
            ValueError,
            match=rf"global_scatter: x: expected an array on cuda \(backend '{name}'\), got torch float32 \(2, 1\) on cpu",
        ):
            uc.global_scatter(torch.ones(2, 1), [2], [2])
        with pytest.raises(
            TypeError,
            match=rf"all_gather: tensor: expected a torch tensor, a cupy array, a jax.Array or a paddle.Tensor \(backend '{name}'\), got numpy",
        ):
            uc.all_gather(None, np.ones(3))
    finally:
        uc.finalize()
        registry._factories.pop(name + "-table")


def test_cupy_nccl_refuses_bfloat16_by_its_table() -> None:
    try:
        _start_with_table("cupy-nccl", cupy_nccl.CAPABILITIES)
        with pytest.raises(
            TypeError, match=r"all_gather: tensor: expected one of the dtypes bool, float16, .*got torch bfloat16"
        ):
            uc.all_gather(None, torch.ones(2, dtype=torch.bfloat16))
    finally:
        uc.finalize()
        registry._factories.pop("cupy-nccl-table")


# -- torch-nccl's stream routing -------------------------------------------------------------


class _FakeWork:
    def __init__(self) -> None:
        self.waits: list[tuple] = []

    def wait(self, *args) -> None:
        self.waits.append(args)

    def is_completed(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("async_op", "calc_stream", "torch_async", "waited_at_once", "returns_work"),
    [(False, True, False, False, False),   # torch's synchronous form: the current stream
     (False, False, True, True, False),    # the NCCL stream, joined at once
     (True, False, True, False, True)],    # the NCCL stream, joined in Task.wait()
)  # fmt: skip
def test_issue_on_stream(async_op, calc_stream, torch_async, waited_at_once, returns_work) -> None:
    launched, work = [], _FakeWork()
    result = issue_on_stream(lambda a: launched.append(a) or work, async_op, calc_stream)
    assert launched == [torch_async]
    assert (work.waits == [()]) is waited_at_once
    assert (result is not None) is returns_work
    if returns_work:
        result.wait(12.0)
        assert work.waits == [()], "Task.wait must not hand torch a timeout (that blocks the host)"


_ON_GLOO = Capabilities(
    ops=torch_nccl.CAPABILITIES.ops,
    dtypes=frozenset({"float32", "int64", "bool"}),
    devices=frozenset({"cpu"}),
    libraries=frozenset({"torch"}),
    reductions=reductions(frozenset({"float32", "int64", "bool"})),
)


def routing_on_gloo(rank: int, all_cases: list) -> dict:
    """Restart this rank on TorchNcclBackend driving gloo, then run the cases."""

    uc.finalize()
    start_on_gloo("nccl-routing", TorchNcclBackend, "nccl-routing", _ON_GLOO)
    return run_cases(rank, all_cases)


def test_torch_nccl_stream_routing_on_gloo() -> None:
    """Every stream mode of TorchNcclBackend's code path gives the reference's results (3 ranks)."""
    matrix = cases(_ON_GLOO, 3, streams=("calc", "comm"))
    assert {c.stream for c in matrix} == {"calc", "comm", None}
    per_rank = uc.testing.spawn(routing_on_gloo, 3, matrix, backend="gloo", timeout=240)
    failures = [f for outcome in per_rank for f in outcome.values() if f]
    assert not failures, failures[0]
    assert set().union(*per_rank) == {c.id for c in matrix}, "a case did not run"
