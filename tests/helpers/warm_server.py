"""What the suite's forkserver loads once, so that the ranks forked from it need not.

``tests/conftest.py`` starts the server that :func:`unicoll.testing.spawn` forks its ranks from
with this module among what it imports:

- one small ``torch.compile`` (``aot_eager``, forward and backward, as the suite compiles): a
  rank's first compile otherwise pays for initializing Dynamo, AOTAutograd, FX and sympy,
  about 2 s of CPU time, against 0.1 s in a rank forked from here. Dynamo's caches and counters
  are emptied afterwards, so no rank sees this graph, and tqdm's monitor thread is kept from
  starting (FX's interpreter opens a progress bar);
- Paddle and JAX, where installed: a world of 2 whose ranks use both took 1.4 s of CPU time
  per rank forked from a server without them, 0.15 s from one with them;
- transformers' modules of the tiny models the expert-parallel tests build
  (helpers/hf_models.py), where installed: the ranks of mpi's Hugging Face case took 2.5 CPU-s
  each forked from a server without them, 0.3-0.4 from one with them;
- what most ranks import after they start (:data:`RANKS_IMPORT`): pytest with the test module
  that holds the rank's function (114 of the suite's 146 ranks, 74 ms each), gloo's transport
  (103 ranks, 13 ms), array-api-compat's torch and numpy namespaces (99 ranks, 15 ms) and the
  helpers of the shared worlds.

None of this starts a thread, so the server forks from its main thread alone. Every forked
rank runs with Dynamo, Paddle, JAX and transformers loaded, as a program that imports
``torch.optim`` and those frameworks does (MPI ranks of ``spawn`` too: they are forked from
here); the ranks of ``unicoll run``, of mpiexec and of ``spawn(start_method="spawn")`` are
fresh interpreters without them.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

import torch
import torch._dynamo
import tqdm
from torch._dynamo.utils import counters

from helpers import hf_models

RANKS_IMPORT = (
    "pytest",
    "array_api_compat.numpy",
    "array_api_compat.torch",
    "unicoll.backends.torch.transport",
    "unicoll.eager.autograd",
    "helpers.several",
    "helpers.conformance",
)
"""Modules that most ranks import after they start. None starts MPI (mpi4py.MPI would) or reads
the registry's entry points (helpers/gpu_backends.py does as it loads: ranks forked from here
would not see a backend package installed later, as tests/backends/test_backend_plugin.py's)."""


def _compile_once() -> None:
    """One small graph compiled, forward and backward."""
    x = torch.ones(3, requires_grad=True)
    torch.compile(lambda t: (t.exp() * 3).sum(), backend="aot_eager", fullgraph=True)(x).backward()


tqdm.tqdm.monitor_interval = 0
_compile_once()
torch._dynamo.reset()
counters.clear()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Paddle's "No ccache found" (for building extensions)
    for name in ("paddle", "jax.numpy"):
        with contextlib.suppress(ImportError):
            __import__(name)
with contextlib.suppress(ImportError):
    hf_models.import_models()
for name in RANKS_IMPORT:
    importlib.import_module(name)
