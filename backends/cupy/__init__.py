"""The ``cupy-nccl`` backend: CuPy's NCCL bindings, with its own send/recv schedule."""
