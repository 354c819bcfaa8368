"""One small ``torch.compile``, run by the suite's forkserver so that its ranks start warm.

``tests/conftest.py`` starts the server that :func:`unicoll.testing.spawn` forks its ranks from
with this module among what it imports. A rank's first compile otherwise pays for initializing
Dynamo, AOTAutograd, FX and sympy: about 2 s of CPU time, against 0.1 s in a rank forked from a
server that compiled once (``aot_eager``, forward and backward, as the suite compiles). Dynamo's
caches and counters are emptied afterwards, so no rank sees this graph, and tqdm's monitor
thread is kept from starting (FX's interpreter opens a progress bar), so the server forks from
its main thread alone.

Every forked rank therefore runs with Dynamo loaded, as a program that imports ``torch.optim``
does; the ranks of MPI jobs, of ``unicoll run`` and of ``spawn(start_method="spawn")`` are fresh
interpreters without it.
"""

from __future__ import annotations

import torch
import torch._dynamo
import tqdm
from torch._dynamo.utils import counters


def _compile_once() -> None:
    """One small graph compiled, forward and backward."""
    x = torch.ones(3, requires_grad=True)
    torch.compile(lambda t: (t.exp() * 3).sum(), backend="aot_eager", fullgraph=True)(x).backward()


tqdm.tqdm.monitor_interval = 0
_compile_once()
torch._dynamo.reset()
counters.clear()
