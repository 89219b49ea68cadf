"""Build the API reference from the docstrings with pdoc; fail on any problem.

    python scripts/build_api_docs.py [OUTPUT_DIR]     (default: build/api, not committed)
        [--package NAME]                              (default: tokentrail)

Every module of the package is documented (the package's `__all__` lists names, not
submodules, so they are passed to pdoc one by one). The build fails (exit 1, the
problems on stderr) when pdoc warns (a module that does not import, a docstring it
cannot parse) or when a docstring names a `tokentrail.…` object in backticks that
pdoc cannot link to: a broken reference.
"""

from __future__ import annotations

import argparse
import os
import pkgutil
import re
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def modules(package: str = "tokentrail") -> list[str]:
    """The package and all its submodules, except `__main__` (which runs the CLI)."""
    root = __import__(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if not info.name.endswith(".__main__"):
            names.append(info.name)
    return names


def unlinked_references(output: Path, package: str = "tokentrail") -> list[str]:
    """`file: name` for every qualified name in `package` that pdoc could not resolve.

    pdoc renders a name it resolves as `<code><a href=...>name</a></code>`; one left as
    plain `<code>package.x</code>` names something that does not exist (any more).
    """
    unlinked = re.compile(rf"<code>({re.escape(package)}(?:\.\w+)+)</code>")
    found = []
    for page in sorted(output.rglob("*.html")):
        for name in sorted(set(unlinked.findall(page.read_text(encoding="utf-8")))):
            found.append(f"{page.relative_to(output)}: `{name}` does not resolve")
    return found


def build(output: Path, package: str = "tokentrail") -> list[str]:
    """Render `package`'s reference into `output`; return the problems (none: clean)."""
    # Defaults are shown as they are: pdoc hides (and warns about) one that happens to
    # equal an environment variable's value, e.g. an engine's name and TOKENTRAIL_EXTRAS.
    os.environ.setdefault("PDOC_DISPLAY_ENV_VARS", "1")
    import pdoc

    names = modules(package)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*names, output_directory=output)
    problems = [
        f"pdoc: {w.message}" for w in caught if "pdoc" in Path(w.filename).parts
    ]
    return problems + unlinked_references(output, package)


def main(argv: list[str] | None = None) -> int:
    """Build the reference; exit 1 with the problems listed when there are any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", type=Path, default=REPO / "build" / "api")
    parser.add_argument("--package", default="tokentrail", help="the package to document")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    problems = build(args.output, args.package)
    for p in problems:
        sys.stderr.write(p.rstrip() + "\n")
    if problems:
        return 1
    sys.stdout.write(f"API reference: {args.output / 'index.html'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
