"""Where one ``moe.dispatch`` + ``moe.combine`` spends its time: torch's profiler over a few steps.

    python -m unicoll run -n 1 benchmarks/moe_step_profile.py --backend torch-nccl

Runs the top-2 step of ``benchmarks/call_overhead.py`` (rows of 1024 float32, 4 experts per rank)
at 64 KiB of tokens per rank and prints, on rank 0, the step's wall time, how many operators
and kernels one step launches, the host's time waiting on the device, and the profiler's table of
operators by their own host time: the list to shorten when the step's front end, not its
transfer, is what costs.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import unicoll as uc

HIDDEN, EXPERTS, TOPK, STEPS = 1024, 4, 2, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="unicoll backend (default: UNICOLL_BACKEND or auto)")
    parser.add_argument("--bytes", type=int, default=64 << 10, help="tokens' bytes per rank (default 64 KiB)")
    parser.add_argument("--rows", type=int, default=25, help="rows of the profiler's table (default 25)")
    args = parser.parse_args()
    uc.init(args.backend)
    cuda = uc.get_backend() in ("torch-nccl", "cupy-nccl")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    world = uc.get_world_size()
    rows = args.bytes // (HIDDEN * 4)
    gen = torch.Generator().manual_seed(uc.get_rank())
    x = torch.randn(rows, HIDDEN, generator=gen).to(device)
    topk_idx = torch.rand(rows, world * EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK].to(device)
    topk_weights = torch.rand(rows, TOPK, generator=gen).to(device)

    def step() -> None:
        dispatched, _, handle = uc.moe.dispatch(x, topk_idx, topk_weights, experts_per_rank=EXPERTS)
        uc.moe.combine(dispatched, handle)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(5):
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    synchronize()
    wall_us = (time.perf_counter() - start) / STEPS * 1e6
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        synchronize()
    if uc.get_rank() == 0:
        events = prof.key_averages()
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        launches = sum(
            e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
        )
        waits = sum(e.self_cpu_time_total for e in events if "Synchronize" in e.key)
        print(f"# moe.dispatch + moe.combine on {uc.get_backend()}, {world} rank(s), {args.bytes} bytes of tokens")
        per_step = f"{ops / STEPS:.0f} aten operators, {launches / STEPS:.0f} kernel launches"
        print(f"step: {wall_us:.1f} us; per step: {per_step}, {waits / STEPS:.1f} us waiting on the device")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    uc.finalize()


if __name__ == "__main__":
    main()
