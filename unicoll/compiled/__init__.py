"""The compile floor: unicoll's operators as ``torch.library`` custom ops
(:mod:`~unicoll.compiled.custom_ops`) and the traced forms that record them
(:mod:`~unicoll.compiled.traced`). Imported on the first call that torch.compile traces; it
runs the eager operators (:mod:`unicoll.eager`) under the lock and never the public face."""
