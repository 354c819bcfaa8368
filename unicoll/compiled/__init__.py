"""The compile floor: unicoll's operators as ``torch.library`` custom ops
(:mod:`~unicoll.compiled.custom_ops`: the data operators' generated from their specs, whose
implementations are the eager operators under the lock), the traced forms that record them
(:mod:`~unicoll.compiled.traced`), and the static-shape MoE step inside ``jax.jit``
(:mod:`~unicoll.compiled.jax_static`). The public face imports the traced forms on the first
call that torch.compile traces, and the carry floor the JAX step on the first call inside
``jax.jit``; nothing here calls the public face."""
