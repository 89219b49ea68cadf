"""GGUF metadata read straight from the header (`tokentrail.vocab.gguf_meta`), with the
`gguf` package's own reader (`GGUFReader`, each field's ``contents()``) as the oracle.

Files: every GGUF vocabulary the corpus holds, llama.cpp's own tokenizer-test
vocabularies in the llama.cpp tree the tests build llama-server from, SmolLM2's model
file, and files written here with `gguf.GGUFWriter` holding every value type, in both
byte orders. A damaged file is a `TokenizerLoadError` naming it, whatever the damage.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import CORPUS
from tests.helpers.llamacpp import llama_cpp_tree_path
from tokentrail import Aligner, TokenizerLoadError
from tokentrail.vocab.gguf_meta import read_metadata

gguf = pytest.importorskip("gguf", reason="the gguf package is the oracle (pip install gguf)")

EVERY = lambda key: True  # noqa: E731


def _oracle(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _found_files() -> list[Path]:
    files = sorted(CORPUS.glob("tokenizers/*/*.gguf")) if CORPUS.exists() else []
    tree = sorted((llama_cpp_tree_path() / "models").glob("ggml-vocab-*.gguf"))
    # The oracle takes 10-20 s on each of the four largest (over 6 MB: Gemma 4, Command R,
    # Llama 3, nomic-bert-moe); test_gguf_llamacpp holds every piece of those equal to
    # llama.cpp's own, through this reader. The corpus's five are copies of files in the
    # tree: each is read once.
    held = {p.name for p in files}
    files += [p for p in tree if p.stat().st_size < 6_000_000 and p.name not in held]
    from tokentrail.models import ModelNotAvailable, resolve

    try:  # where `python -m tokentrail.models fetch smollm2` put it (CI does)
        return [*files, resolve("smollm2")]
    except ModelNotAvailable:
        return files


FOUND = _found_files()


@pytest.mark.parametrize("path", FOUND, ids=[p.name for p in FOUND])
def test_every_key_equals_the_gguf_packages(path: Path) -> None:
    assert read_metadata(path, EVERY) == _oracle(path)


def test_there_are_files_to_compare() -> None:
    # Off CI the corpus or the llama.cpp tree may be missing; the written files below
    # run everywhere. In CI both are there: 5 corpus files and 10 more of llama.cpp's.
    import os

    if os.environ.get("CI") == "true":
        assert len(FOUND) >= 15, FOUND


def _write(path: Path, endian: Any) -> Path:
    """A GGUF with one key of every value type (and arrays of each), tensors none."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", -0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve 東京 🙂")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_string("t.empty", "")
    w.add_array("t.strings", ["", "a", "▁Hello", "<0xE4>", "東京"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1e30, 3.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.none", [])
    w.add_token_list(["<unk>", "<s>", "</s>", "▁a", "b"])
    w.add_token_types([2, 3, 3, 1, 1])
    w.add_token_scores([0.0, 0.0, 0.0, -1.5, -2.5])
    w.add_tokenizer_model("llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("order", ["little", "big"])
def test_every_value_type_in_either_byte_order(tmp_path: Path, order: str) -> None:
    endian = gguf.GGUFEndian.LITTLE if order == "little" else gguf.GGUFEndian.BIG
    path = _write(tmp_path / f"{order}.gguf", endian)
    ours = read_metadata(path, EVERY)
    assert ours == _oracle(path)
    assert ours["t.u64"] == 2**63 + 5 and ours["t.str"] == "naïve 東京 🙂"
    assert ours["t.bools"] == [True, False, True] and ours["t.bool"] is True
    assert ours["t.f32"] == struct.unpack("<f", struct.pack("<f", -0.1))[0]


def test_only_the_keys_asked_for_are_read(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", gguf.GGUFEndian.LITTLE)
    got = read_metadata(path, lambda k: k.startswith("tokenizer.ggml."))
    assert set(got) == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                        "tokenizer.ggml.scores", "tokenizer.ggml.model"}  # fmt: skip


def test_invalid_utf8_is_refused_only_where_it_is_read(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", gguf.GGUFEndian.LITTLE)
    data = bytearray(path.read_bytes())
    at = data.index("東京".encode(), data.index(b"t.strings"))
    data[at] = 0xFF  # the first byte of an array entry of t.strings
    path.write_bytes(bytes(data))
    assert read_metadata(path, lambda k: k != "t.strings")["t.str"] == "naïve 東京 🙂"
    with pytest.raises(TokenizerLoadError, match=r"t\.strings is not valid UTF-8"):
        read_metadata(path, EVERY)


def test_version_1_and_a_missing_magic_are_named(tmp_path: Path) -> None:
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(TokenizerLoadError, match="GGUF version 1 is not supported"):
        read_metadata(old, EVERY)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(TokenizerLoadError, match="no GGUF magic"):
        read_metadata(other, EVERY)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(TokenizerLoadError, match=str(empty)):
        Aligner(str(empty))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_a_damaged_file_is_a_load_error_naming_it(tmp_path: Path, data: st.DataObject) -> None:
    """Cut anywhere, or with bytes overwritten anywhere: the values, or a
    `TokenizerLoadError` naming the file, never another exception or a hang (a corrupt
    length or count points past the end of the file)."""
    path = tmp_path / "whole.gguf"
    if not path.exists():
        _write(path, gguf.GGUFEndian.LITTLE)
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(4, len(raw) - 1))] = data.draw(st.integers(0, 255))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    try:
        got = read_metadata(bad, EVERY)
    except TokenizerLoadError as e:
        assert str(bad) in str(e)
    else:
        assert isinstance(got, dict)


def test_a_gguf_vocabulary_needs_no_package(tmp_path: Path) -> None:
    """The default llama.cpp reference reads a GGUF with the stdlib alone: with the
    `gguf` package's import blocked, the vocabulary is the same."""
    import subprocess
    import sys

    path = _write(tmp_path / "m.gguf", gguf.GGUFEndian.LITTLE)
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "from tokentrail import load_vocab\n"
        f"v = load_vocab({str(path)!r})\n"
        "print(v.size, [v.pieces[i] for i in range(v.size)])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    from tokentrail import load_vocab

    v = load_vocab(path)
    assert done.stdout.strip() == f"{v.size} {[v.pieces[i] for i in range(v.size)]}"
