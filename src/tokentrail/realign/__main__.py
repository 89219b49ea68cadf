"""`python -m tokentrail.realign ...`: the same as `tokentrail realign`."""

from .cli import main

raise SystemExit(main())
