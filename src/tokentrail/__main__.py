"""`python -m tokentrail` runs the command line (the same as the `tokentrail` script)."""

from .cli import main

raise SystemExit(main())
