"""The front end of a top-k dispatch whose routing changes every call, on one rank with the
transport stubbed out: the host path against the device path, per call, in microseconds.

    python benchmarks/dispatch_front_end.py              # CPU tensors: gloo, and the device path on them
    python benchmarks/dispatch_front_end.py --cuda       # on a GPU: torch-nccl's device path too

The host path is gloo's (the routing sorted by numpy on the host). The device path is
torch-nccl's code (:class:`~unicoll.backends.torch.transport.TorchNcclBackend`): on CPU tensors
it drives gloo, as the suite runs it; with ``--cuda`` it is torch-nccl itself on CUDA tensors.
Each call is ``moe.dispatch`` (and then ``moe.combine``) of tokens routed anew (one of a few
routings drawn beforehand, in turn), inside ``unicoll.runtime.transport_stubbed``, so what is
timed is everything but the bytes' transfer: validation, the routing, the counts' exchange and
read (the one host read), the gathers and reorders, the weighted sum. The floor beside it is the
local work any implementation must do on the same device: one gather of the rows sent and one
gather with a ``(1, k) @ (k, row)`` product back.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import unicoll as uc
from unicoll import registry
from unicoll.backends.base import Capabilities, reductions
from unicoll.backends.torch import nccl as torch_nccl
from unicoll.backends.torch.transport import TorchNcclBackend
from unicoll.runtime import transport_stubbed

TOKENS, TOPK, EXPERTS, HIDDEN = 1024, 2, 8, 64
ROUTINGS, CALLS, BLOCKS = 8, 50, 15


class _OnGloo:
    """torch-nccl's backend class driving gloo on CPU tensors (its device path on the host)."""

    capabilities = Capabilities(
        ops=torch_nccl.CAPABILITIES.ops, dtypes=frozenset({"float32", "int64"}), devices=frozenset({"cpu"}),
        libraries=frozenset({"torch"}), reductions=reductions(frozenset({"float32"})),
    )  # fmt: skip

    def probe(self) -> None:
        return None

    def __call__(self, *, rank: int, world_size: int, timeout: float) -> Any:
        return TorchNcclBackend("device-path", "gloo", self.capabilities, rank=rank, world_size=world_size,
                                timeout=timeout)  # fmt: skip


def _per_call(fn: Callable[[int], Any], cuda: bool) -> float:
    """Median microseconds per call of ``fn(i)`` over blocks of CALLS calls (2 blocks of warm-up)."""
    blocks = []
    for _ in range(BLOCKS + 2):
        start = time.perf_counter()
        for i in range(CALLS):
            fn(i)
        if cuda:
            torch.cuda.synchronize()
        blocks.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(blocks[2:])


def _timings(device: str, cuda: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device)
    weights = torch.rand(TOKENS, TOPK, generator=gen).to(device)
    routings = [torch.rand(TOKENS, EXPERTS, generator=gen).argsort(1)[:, :TOPK].to(device) for _ in range(ROUTINGS)]
    slots = [r.reshape(-1).argsort(stable=True) for r in routings]

    def dispatch(i: int) -> Any:
        return uc.moe.dispatch(x, routings[i % ROUTINGS], weights, experts_per_rank=EXPERTS)

    def step(i: int) -> Any:
        rows, _, handle = dispatch(i)
        return uc.moe.combine(rows, handle)

    def floor(i: int) -> Any:
        order = slots[i % ROUTINGS]
        rows = x.index_select(0, order // TOPK)
        back = rows.index_select(0, order.argsort()).reshape(TOKENS, TOPK, HIDDEN)
        return torch.bmm(weights.reshape(TOKENS, 1, TOPK), back)

    with transport_stubbed():
        return {"dispatch": _per_call(dispatch, cuda), "dispatch+combine": _per_call(step, cuda),
                "floor": _per_call(floor, cuda)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="also torch-nccl on CUDA tensors")
    args = parser.parse_args()
    registry.register_backend("device-path", _OnGloo())
    paths = [("host path (gloo)", "gloo", "cpu"), ("device path on CPU", "device-path", "cpu")]
    if args.cuda:
        paths.append(("device path (torch-nccl)", "torch-nccl", "cuda"))
    print(f"# one rank, {TOKENS} tokens x top-{TOPK}, {EXPERTS} experts, rows of {HIDDEN} float32, a new routing")
    print("# every call, transport stubbed; median microseconds per call")
    print(f"{'path':>26} {'dispatch':>10} {'dispatch+combine':>17} {'floor':>8} {'over floor':>11}")
    for name, backend, device in paths:
        uc.init(backend)
        try:
            t = _timings(device, device == "cuda")
        finally:
            uc.finalize()
        over = t["dispatch+combine"] - t["floor"]
        print(f"{name:>26} {t['dispatch']:>10.1f} {t['dispatch+combine']:>17.1f} {t['floor']:>8.1f} {over:>11.1f}")


if __name__ == "__main__":
    main()
