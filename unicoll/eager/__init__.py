"""The eager floor: every operator as a plain function that validates its call, runs it on the
backend and hands back the caller's kind, with its backward beside it. Nothing here knows of
torch.compile. The floors above (:mod:`unicoll.compiled`, the public face :mod:`unicoll.face`)
call the operators under the one-thread lock; the backward passes, which autograd runs, and
:func:`~unicoll.eager.agreed.all_reduce_agreed`, which unicoll.nn issues from backward hooks,
take it themselves."""
