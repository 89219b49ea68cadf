"""tokentrail's test suite: a package, so test modules import `tests.helpers` normally."""
