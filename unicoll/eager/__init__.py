"""The eager floor: every operator as a plain function that validates its call, runs it on the
backend and hands back the caller's kind, with its backward beside it. Nothing here knows of
torch.compile or takes the one-thread lock: the floors above (:mod:`unicoll.compiled`, the
public face :mod:`unicoll.face`) call these functions under it."""
