"""Hugging Face `tokenizers` (tokenizer.json): the decoder pipeline compiled per token.

The decoder steps (ByteLevel, ByteFallback, Metaspace, Replace, Strip, Fuse, WordPiece,
none) are simulated on every token's string, so the aligner knows each token's bytes, the
first-token variants (Metaspace, Strip) and the byte-fallback runs. A pipeline that is not
per-token plus these rules takes the generic path. The oracle is `Tokenizer.decode`, plus
transformers' clean-up of spaces when the folder's tokenizer_config.json asks for it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from .core import BYTE_TOKEN, Vocab, byte_level_alphabet, special_names, wordpiece_cleanup

log = logging.getLogger(__name__)


def _flatten(decoder: Any) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        out: list[dict[str, Any]] = []
        for d in decoder.get("decoders", []):
            out.extend(_flatten(d))
        return out
    return [decoder]


class _Unsupported(Exception):
    pass


#: (pieces, first_pieces, byte_ids, byte_mode, strip_leading, run_edits)
_Compiled = tuple[
    list[bytes | None], dict[int, bytes], frozenset[int], str, int, tuple[tuple[str, str, str], ...]
]


class _Pipeline:
    """A tokenizers decoder pipeline simulated per token, one method per decoder kind
    (in the spirit of tokenizers' one class per decoder).

    `cur[i]` is token i's piece so far (str until a step turns it into bytes; None for
    a token with no text); `first[i]` what the piece becomes when the token starts
    the text (Metaspace's prefix space, WordPiece's lack of a joining space); byte ids
    are `<0xNN>` tokens already turned into their byte. Once the text is fused, only
    a leading-space Strip can still follow.
    """

    def __init__(self, tokens: list[str | None]) -> None:
        self.cur: list[str | bytes | None] = list(tokens)
        self.first: dict[int, str | bytes] = {}
        self.byte_ids: set[int] = set()
        self.mode = "stream"
        self.fused = False
        self.strip_leading = 0
        #: Replacements the steps after an unfused ByteFallback make on each byte-run
        #: string: (old, new, new in the first string); see `Vocab.run_edits`.
        self.run_edits: list[tuple[str, str, str]] = []

    @property
    def runs_open(self) -> bool:
        """Whether byte runs reach the next step as strings of their own (ByteFallback
        done, no Fuse yet): tokenizers applies each later step to a run's whole text."""
        return self.mode == "hf_runs" and not self.fused

    def each(self, fn: Any) -> None:
        """Apply `fn` to every text piece (not to byte tokens), first forms included."""
        cur, byte_ids = self.cur, self.byte_ids
        for i, s in enumerate(cur):
            if s is not None and i not in byte_ids:
                cur[i] = fn(s)
        for i, s in list(self.first.items()):
            self.first[i] = fn(s)

    def apply(self, step: dict[str, Any]) -> None:
        kind = step.get("type")
        if self.fused:
            if kind == "Strip" and step.get("content") == " " and step.get("stop", 0) == 0:
                self.strip_leading += int(step.get("start", 0))
                return
            raise _Unsupported(f"{kind} after the text is fused")
        method = _STEPS.get(kind)  # type: ignore[arg-type]
        if method is None:
            raise _Unsupported(f"decoder step {kind}")
        method(self, step)

    def replace(self, step: dict[str, Any]) -> None:
        pattern = step.get("pattern", {})
        if "String" not in pattern:
            raise _Unsupported("Replace with a regex pattern")
        old, new = pattern["String"], step.get("content", "")
        self.each(lambda s: s.replace(old, new) if isinstance(s, str) else s)
        if self.runs_open:
            self.run_edits.append((old, new, new))

    def byte_fallback(self, step: dict[str, Any]) -> None:
        for i, s in enumerate(self.cur):
            if isinstance(s, str):
                m = BYTE_TOKEN.match(s)
                if m:
                    self.cur[i] = bytes([int(m.group(1), 16)])
                    self.byte_ids.add(i)
                    self.first.pop(i, None)
        self.mode = "hf_runs"

    def fuse(self, step: dict[str, Any]) -> None:
        self.fused = True

    def strip(self, step: dict[str, Any]) -> None:
        if self.runs_open:
            raise _Unsupported("Strip on byte-fallback runs that are not fused")
        c = step.get("content", " ")
        a, b = int(step.get("start", 0)), int(step.get("stop", 0))

        def strip(s: Any) -> Any:
            if not isinstance(s, str):
                return s
            i = 0
            while i < a and i < len(s) and s[i] == c:
                i += 1
            j = len(s)
            while len(s) - j < b and j > i and s[j - 1] == c:
                j -= 1
            return s[i:j]

        self.each(strip)

    def byte_level(self, step: dict[str, Any]) -> None:
        alphabet = byte_level_alphabet()
        # A token made only of alphabet characters maps to their bytes; any other
        # character makes tokenizers keep the token's own UTF-8 (added tokens).
        table = str.maketrans({c: chr(b) for c, b in alphabet.items()})
        outside = re.compile("[^" + re.escape("".join(alphabet)) + "]")

        def to_bytes(s: Any) -> Any:
            if not isinstance(s, str):
                return s
            if outside.search(s):
                return s.encode("utf-8")
            return s.translate(table).encode("latin-1")

        self.each(to_bytes)
        if self.mode == "hf_runs":
            raise _Unsupported("ByteLevel after ByteFallback")
        self.fused = True

    def metaspace(self, step: dict[str, Any]) -> None:
        repl = step.get("replacement", "▁")
        scheme = step.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if step.get("add_prefix_space", True) else "never"
        for i, s in enumerate(self.cur):
            if isinstance(s, str) and i not in self.byte_ids:
                f = self.first.get(i, s)
                if scheme != "never" and isinstance(f, str):
                    self.first[i] = f.replace(repl, "")
                self.cur[i] = s.replace(repl, " ")
        if self.runs_open:
            # A run's text is one string to Metaspace: its "▁" become spaces, and when
            # it is the decode's first string, every one of them is dropped.
            self.run_edits.append((repl, " ", "" if scheme != "never" else " "))

    def join(self, step: dict[str, Any]) -> None:
        """WordPiece (and the no-decoder default): tokens joined with single spaces,
        except that a WordPiece continuation (`##x`) joins without one."""
        if self.runs_open:
            raise _Unsupported(f"{step.get('type')} on byte-fallback runs that are not fused")
        wordpiece = step.get("type") == "WordPiece"
        prefix = step.get("prefix", "##") if wordpiece else None
        do_clean = bool(step.get("cleanup", False)) if wordpiece else False
        for i, s in enumerate(self.cur):
            if not isinstance(s, str):
                continue
            f = self.first.get(i, s)
            has_prefix = prefix is not None and s.startswith(prefix)
            s = s[len(prefix or "") :] if has_prefix else " " + s
            self.cur[i] = wordpiece_cleanup(s) if do_clean else s
            if isinstance(f, str):
                self.first[i] = wordpiece_cleanup(f) if do_clean else f
        self.fused = not wordpiece

    def result(self) -> _Compiled:
        def as_bytes(s: str | bytes) -> bytes:
            return s if isinstance(s, bytes) else s.encode("utf-8")

        pieces = [None if s is None else as_bytes(s) for s in self.cur]
        first_b = {i: as_bytes(s) for i, s in self.first.items() if as_bytes(s) != pieces[i]}
        if self.strip_leading:
            first_b = self._stripped_first(pieces)
        edits = tuple(self.run_edits)
        return pieces, first_b, frozenset(self.byte_ids), self.mode, self.strip_leading, edits

    def _stripped_first(self, pieces: list[bytes | None]) -> dict[int, bytes]:
        """First forms for a Strip of leading spaces after Fuse: a text token that starts
        the text loses them there, so its bytes are what it really adds (the same bytes
        sentencepiece's dummy-prefix rule gives it). A byte token's run is only decided
        later (an invalid run keeps its space as U+FFFD), so the aligner strips the text
        after those."""
        if self.first:
            # Which spaces the Strip removes from a Metaspace / WordPiece first form is
            # not known per token; the generic path is exact.
            raise _Unsupported("Strip after Fuse on top of first-token forms")
        n = self.strip_leading
        first: dict[int, bytes] = {}
        for i, b in enumerate(pieces):
            if b is None or i in self.byte_ids:
                continue
            k = 0
            while k < n and k < len(b) and b[k] == 0x20:
                k += 1
            if k:
                first[i] = b[k:]
        return first


_STEPS: dict[str, Any] = {
    "Replace": _Pipeline.replace,
    "ByteFallback": _Pipeline.byte_fallback,
    "Fuse": _Pipeline.fuse,
    "Strip": _Pipeline.strip,
    "ByteLevel": _Pipeline.byte_level,
    "Metaspace": _Pipeline.metaspace,
    "WordPiece": _Pipeline.join,
    "_join": _Pipeline.join,
}


def _compile_decoder(
    steps: list[dict[str, Any]], tokens: list[str | None]
) -> _Compiled:
    """Simulate a tokenizers decoder pipeline per token.

    Returns (pieces, first_pieces, byte_ids, byte_mode, strip_leading, run_edits). Raises
    `_Unsupported` for a pipeline whose effect is not per-token plus the known
    whole-text rules, so that the caller can fall back to the generic path.
    """
    pipeline = _Pipeline(tokens)
    for step in steps or [{"type": "_join"}]:  # no decoder: tokens joined with spaces
        pipeline.apply(step)
    return pipeline.result()


def _decoded_forms(tok: Any, added: list[dict[str, Any]], tokens: list[str | None]) -> None:
    """Put in `tokens` the string the decoder really receives for each added token.

    `Tokenizer.decode` looks each id up as `Tokenizer.id_to_token` does (tokenizer/mod.rs:
    both call `AddedVocabulary::simple_id_to_token`, then the model), so that answer is
    the library's own. It need not be the token's content: since tokenizers 0.23
    (huggingface/tokenizers#1995) a `normalized` added token is handed over in its
    normalized form, so under Llama 2's legacy normalizer (Prepend "▁", Replace " " ->
    "▁") `<tok>` decodes as `▁<tok>` and the decoder puts a space before it; a
    lower-casing normalizer lower-cases it. Older versions pass the content.
    """
    for a in added:
        i = int(a["id"])
        form = tok.id_to_token(i)
        if form is not None:
            tokens[i] = form


def _skipped_ids(added: list[dict[str, Any]], tokens: list[str | None]) -> set[int]:
    """The ids `Tokenizer.decode(..., skip_special_tokens=True)` drops.

    tokenizers drops a token when the string it decodes (see `_decoded_forms`) is
    the content of an added token flagged `special` (tokenizer/mod.rs `decode`,
    `AddedVocabulary::is_special_token`, a set of contents). So a token the file does
    not flag special stays, whatever its name (`<unk>` with `special: false`), and a
    special token whose normalized form differs from its content stays too.
    """
    contents = {a["content"] for a in added if a.get("special")}
    return {i for i, s in enumerate(tokens) if s is not None and s in contents}


def vocab_from_hf_tokenizer(
    tok: Any,
    name: str = "tokenizers.Tokenizer",
    config: dict[str, Any] | None = None,
    cleanup: bool | None = None,
    oracle: Any = None,
    special_ids: set[int] | None = None,
    spec: dict[str, Any] | None = None,
) -> Vocab:
    """Compile a `tokenizers.Tokenizer` (and its decoder pipeline) into a Vocab.

    `spec` is the tokenizer's JSON when the caller has already parsed it.
    """
    if spec is None:
        spec = json.loads(tok.to_str())
    size = tok.get_vocab_size(with_added_tokens=True)
    table = tok.get_vocab(with_added_tokens=True)
    size = max(size, max(table.values(), default=-1) + 1)
    tokens: list[str | None] = [None] * size
    for s, i in table.items():
        tokens[i] = s
    added_tokens = [a for a in spec.get("added_tokens", []) if 0 <= int(a["id"]) < size]
    _decoded_forms(tok, added_tokens, tokens)
    special = _skipped_ids(added_tokens, tokens) | set(special_ids or ())
    if cleanup is None:
        cleanup = bool((config or {}).get("clean_up_tokenization_spaces", False))

    def reference(ids: Sequence[int], skip: bool) -> str:
        return tok.decode(list(ids), skip_special_tokens=skip)

    try:
        pieces, first, byte_ids, mode, strip, run_edits = _compile_decoder(
            _flatten(spec.get("decoder")), tokens
        )
    except _Unsupported as why:
        from .generic import generic_vocab

        log.info("%s: %s; using the generic decode path", name, why)
        return generic_vocab(
            tokens, special, oracle or reference, name=name, cleanup=bool(cleanup), source=tok
        )
    if oracle is None:
        if cleanup:

            def oracle(ids: Sequence[int], skip: bool) -> str:
                return cleanup(reference(ids, skip))
        else:
            oracle = reference
    return Vocab(
        pieces=pieces,
        name=name,
        special=frozenset(special),
        byte_ids=byte_ids,
        byte_mode=mode,  # type: ignore[arg-type]
        first_pieces=first,
        strip_leading=strip,
        run_edits=run_edits,
        cleanup=bool(cleanup),
        names=special_names(tokens, special),
        oracle=oracle,
        source=tok,
    )
