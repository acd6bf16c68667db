"""``python -m kvstage``: the same command line as the ``kvstage`` script."""

from kvstage.cli import main

raise SystemExit(main())
