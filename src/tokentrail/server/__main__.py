"""`python -m tokentrail.server ...`: the same options as `tokentrail serve`."""

from .cli import main

raise SystemExit(main())
