"""``python -m qcore ...``: the same command line as the ``qcore`` script (see src/qcore/cli.py)."""

from .cli import main

raise SystemExit(main())
