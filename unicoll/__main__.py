"""``python -m unicoll``: the same command line as ``unicoll`` (see :mod:`unicoll.cli`)."""

from .cli import main

raise SystemExit(main())
