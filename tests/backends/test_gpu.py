"""GPU-only behaviour at world size 1 (NCCL refuses two ranks on one GPU): autograd on CUDA
tensors, stream ordering in every mode and for both array libraries, Task.wait() that does
not block the host, and counts given as CUDA arrays. Skipped, with the reason, without CUDA;
the conformance matrix (test_conformance_gpu.py) covers the results of every case."""

from __future__ import annotations

import time

import numpy as np
import pytest

import unicoll as uc
from helpers.gpu_backends import params
from helpers.gradients import gradients

ROWS = 1 << 16  # 256 KiB of float32 per operand
BUSY_CYCLES = 400_000_000  # a few hundred ms of one GPU thread spinning, on any current GPU


@pytest.mark.parametrize("backend", params())
def test_gradients_on_cuda(backend) -> None:
    """Every operator's backward on CUDA tensors (on cupy-nccl, torch tensors viewed as cupy arrays and back)."""
    (report,) = uc.testing.spawn(gradients, 1, "cuda", backend=backend, timeout=300)
    assert set(report.values()) == {"ok"}


class _Library:
    """What the stream tests need from torch or cupy: arrays, a side stream, a busy kernel."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "torch":
            import torch

            self.xp = torch
        else:
            import cupy

            self.xp = cupy
            self._spin = cupy.RawKernel(
                r"""extern "C" __global__ void spin(long long cycles) {
                    long long start = clock64();
                    while (clock64() - start < cycles) { }
                }""",
                "spin",
            )

    def zeros(self, rows: int):
        if self.name == "torch":
            return self.xp.zeros(rows, 1, device="cuda")
        return self.xp.zeros((rows, 1), dtype=self.xp.float32)

    def side_stream(self):
        """A new stream, made current by ``with``."""
        if self.name == "torch":
            stream = self.xp.cuda.Stream()
            return self.xp.cuda.stream(stream)
        return self.xp.cuda.Stream(non_blocking=True)

    def busy(self) -> None:
        """Keep the current stream busy for a while (nothing else runs on it meanwhile)."""
        if self.name == "torch":
            self.xp.cuda._sleep(BUSY_CYCLES)
        else:
            self._spin((1,), (1,), (np.int64(BUSY_CYCLES),))

    def stream_busy(self) -> bool:
        """Whether the current stream still has work queued (a host-side query, no wait)."""
        if self.name == "torch":
            return not self.xp.cuda.current_stream().query()
        return not self.xp.cuda.get_current_stream().done

    def all_equal(self, y, value: float) -> bool:
        """Whether every element of ``y`` is ``value`` (read on the current stream)."""
        return bool((y == value).all().item())


def stream_order(rank: int, library: str) -> dict[str, object]:
    """Write x on a side stream after a busy kernel and run each operator mode on that stream:
    every result must see the write (the transfer waited for the caller's stream), and
    Task.wait() must return while the GPU is still busy (the host is not blocked)."""
    lib = _Library(library)
    report: dict[str, object] = {}
    with lib.side_stream():
        for mode, kw in (("calc", dict(use_calc_stream=True)), ("comm", dict(use_calc_stream=False))):
            x = lib.zeros(ROWS)
            lib.busy()
            x += 7
            y = uc.alltoall_single(None, x, **kw)
            report[f"{mode}: result sees the write"] = lib.all_equal(y, 7)
            z = uc.global_scatter(x, [ROWS], [ROWS], **kw)
            report[f"{mode}: global_scatter sees the write"] = lib.all_equal(z, 7)
        x = lib.zeros(ROWS)
        lib.busy()
        x += 5
        task = uc.alltoall_single(None, x, sync_op=False)  # even splits: nothing exchanged first
        report["async: not completed while the stream is busy"] = not task.is_completed()
        start = time.perf_counter()
        y = task.wait()
        report["async: wait() took (s)"] = time.perf_counter() - start
        report["async: the stream still busy after wait()"] = lib.stream_busy()
        report["async: result sees the write"] = lib.all_equal(y, 5)
        report["async: library"] = type(y).__module__.split(".")[0]
    return report


@pytest.mark.parametrize(("backend", "library"), params(("torch",), ("cupy",)))
def test_stream_order_and_non_blocking_wait(backend, library) -> None:
    (report,) = uc.testing.spawn(stream_order, 1, library, backend=backend, timeout=300)
    assert report.pop("async: library") == library
    assert report.pop("async: wait() took (s)") < 0.05, "Task.wait() blocked the host"
    assert all(report.values()), report


def counts_on_device(rank: int, library: str) -> dict[str, bool]:
    """Counts given as CUDA arrays give what host counts give; exchange_counts keeps their kind."""
    lib = _Library(library)
    xp = lib.xp
    lc_host = [3, 0, 2, 1]  # E = 4 experts on the only rank
    lc = xp.asarray(lc_host, device="cuda") if library == "torch" else xp.asarray(lc_host)
    gc = uc.exchange_counts(lc)
    x = lib.zeros(6)
    x += 1
    on_device = uc.global_scatter(x, lc, gc)
    on_host = uc.global_scatter(x, lc_host, lc_host)
    same_kind = type(gc) is type(lc) and (gc.device == lc.device if library == "torch" else True)
    return {
        "exchange_counts keeps the library and device": same_kind,
        "exchange_counts is the identity on one rank": bool((gc == lc).all().item()),
        "device counts give the host counts' result": bool((on_device == on_host).all().item()),
    }


@pytest.mark.parametrize(("backend", "library"), params(("torch",), ("cupy",)))
def test_counts_on_device(backend, library) -> None:
    (report,) = uc.testing.spawn(counts_on_device, 1, library, backend=backend, timeout=300)
    assert all(report.values()), report


@pytest.mark.parametrize("backend", params())
def test_moe_example_on_the_gpu(backend) -> None:
    """examples/moe_dispatch.py checks its own output, gradients and round trip on CUDA."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "moe_dispatch.py"
    command = [sys.executable, "-m", "unicoll", "run", "-n", "1", str(example), "--backend", backend, "--iters", "3"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"backend {backend}: 1 ranks" in out.stdout


@pytest.mark.parametrize("backend", params())
def test_training_example_on_the_gpu(backend) -> None:
    """examples/train_moe.py checks every loss and parameter against its dense model on CUDA."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "train_moe.py"
    command = [sys.executable, "-m", "unicoll", "run", "-n", "1", str(example), "--backend", backend, "--steps", "5"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"backend {backend}: 1 ranks x 2 experts, 5 Adam steps: every loss and every parameter match" in out.stdout


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "complex128", "bool"])
@pytest.mark.parametrize("shape", [(300, 1024), (300, 8, 16), (300, 33), (300, 3), (300,), (0, 64), (300, 0)])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("backend", [p for p in params() if p.values[0] == "cupy-nccl"])
def test_cupy_row_gather_moves_the_same_bits(backend, dtype, shape, aligned) -> None:
    """cupy-nccl's row gather (a kernel of 16-byte words, else take on wide words) against
    numpy's fancy indexing, bit for bit: every path, repeated rows, an input off 16-byte alignment."""
    import cupy

    from unicoll.backends.cupy.rows import take_rows

    rng = np.random.default_rng(1)
    dt = np.dtype(dtype)
    if dtype == "bool":
        host = rng.integers(0, 2, shape).astype(bool)
    else:
        host = rng.integers(0, 256, (*shape, dt.itemsize), dtype=np.uint8).view(dt).reshape(shape)
    if aligned:
        x = cupy.asarray(host)
    else:  # one element into a fresh allocation: off 16-byte alignment unless an element is 16 bytes
        x = cupy.empty(host.size + 1, dtype=dt)[1:].reshape(shape)
        x[...] = cupy.asarray(host)
    index = rng.integers(0, max(shape[0], 1), 2 * shape[0]) if shape[0] else np.zeros(0, np.int64)
    got = take_rows(x, index)
    assert got.dtype == dt and got.shape == (len(index), *shape[1:])
    assert cupy.asnumpy(got).tobytes() == host[index].tobytes()


def torch_on_cupy_nccl(rank: int) -> dict[str, bool]:
    """Torch tensors through cupy-nccl's bridge (backends/cupy/torch_bridge.py): a functional
    result is a new tensor of torch's allocator with the right rows, an in-place result is the
    caller's memory, and both see a write queued behind a busy kernel on a torch side stream
    (the bridge's stream handshake) and are seen by torch's stream after the transfer."""
    import cupy
    import torch

    from unicoll.backends.cupy import torch_bridge

    lib, report = _Library("torch"), {}
    for where, stream in (("same stream", None), ("torch side stream", torch.cuda.Stream())):
        with torch.cuda.stream(stream):
            x = torch.arange(ROWS, dtype=torch.float32, device="cuda").reshape(-1, 1)
            lib.busy()
            x += 1
            y = uc.alltoall_single(None, x, use_calc_stream=False)
            report[f"{where}: a new tensor"] = type(y) is torch.Tensor and y.data_ptr() != x.data_ptr()
            report[f"{where}: its rows"] = bool((y == x).all().item())
            lib.busy()
            x *= 2
            same = uc.all_reduce(x)
            report[f"{where}: all_reduce in place"] = same is x or same.data_ptr() == x.data_ptr()
            report[f"{where}: the write behind the busy kernel"] = bool((x == 2 * y).all().item())
    view = torch.zeros(8, 4, device="cuda")
    part = torch_bridge.as_cupy(view)[2:5]  # part of a tensor: back through DLPack, the same memory
    back = torch_bridge.as_torch(part)
    back += 3
    report["a view of part of a tensor goes back as a view"] = bool((view[2:5] == 3).all().item())
    report["cupy's own arrays go back through DLPack"] = bool((torch_bridge.as_torch(cupy.ones(4)) == 1).all().item())
    return report


@pytest.mark.parametrize("backend", [p for p in params() if p.values[0] == "cupy-nccl"])
def test_torch_tensors_cross_cupy_nccl(backend) -> None:
    (report,) = uc.testing.spawn(torch_on_cupy_nccl, 1, backend=backend, timeout=300)
    assert all(report.values()), report
