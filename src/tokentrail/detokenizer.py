"""A drop-in for mlx-lm's streaming detokenizers that also says which tokens made each
piece of text (`last_segment_tokens`), with exact text for every tokenizer family.

    from mlx_lm import load, stream_generate
    import tokentrail

    model, tokenizer = load("path/to/model")
    detok = tokentrail.detokenizer.install(tokenizer)   # replaces mlx-lm's pick
    for response in stream_generate(model, tokenizer, prompt):
        ...   # response.text is exact; see StreamingDetokenizer for the tokens

mlx-lm's `stream_generate` takes its own copy of the installed detokenizer
(`TokenizerWrapper.detokenizer` is `copy.copy` + `reset`) and reads `last_segment` once
per token. Every copy reports back to the object `install` returned: right after each
response, `detok.last_segment_tokens` are the tokens behind that response's `text`,
whichever copy produced it. (With several streams at once, the template holds the last
read of any of them; read the copy a stream uses for per-stream state.)

The text is the tokenizer's own decode of the tokens fed; `like_mlx_lm=True` gives the
text mlx-lm's own detokenizer gives instead (its byte-level BPE detokenizer drops a
reply's first leading space), for callers that must not change a byte of their output.
`install` also takes an object that keeps a detokenizer of its own next to its
`tokenizer` (mlx-engine's model kits, which copy `kit.detokenizer` per request).
"""

from __future__ import annotations

import copy
from typing import Any

from .align import Aligner
from .segment import Segment, TokenSpan
from .stops import WholeTokens, drop_first_space


class StreamingDetokenizer:
    """mlx-lm's StreamingDetokenizer interface (`reset`, `add_token`, `finalize`, `text`,
    `tokens`, `offset`, `last_segment`) backed by the exact aligner.

    `last_segment` returns the text that became final since it was last read, as in
    mlx-lm; reading it also sets `last_segment_tokens` to the tokens behind exactly that
    text (each with index, id and the byte range it contributed), and
    `last_segment_spans` to the segments themselves. `add_token(token, logprob,
    top_logprobs)` also takes the token's logprob and (id, logprob) alternatives, which
    the spans then carry. `like_mlx_lm`: see the module's docstring. `whole_tokens=True`:
    each token is listed once, in the read whose text completes it (a token whose bytes
    reach two reads is listed in the later one, with its whole byte range).
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = False,
        like_mlx_lm: bool = False,
        whole_tokens: bool = False,
    ) -> None:
        self._aligner = (
            tokenizer
            if isinstance(tokenizer, Aligner)
            else Aligner(tokenizer, skip_special_tokens=skip_special_tokens)
        )
        #: Whether mlx-lm's own detokenizer for this tokenizer drops a first space, and
        #: whether this one does (`like_mlx_lm`).
        self.replaced_bpe = mlx_lm_drops_first_space(tokenizer)
        self.drops_first_space = like_mlx_lm and self.replaced_bpe
        self.whole_tokens = whole_tokens
        #: The detokenizer this one was copied from (the installed template), or None.
        self._root: StreamingDetokenizer | None = None
        self.reset()

    def __copy__(self) -> StreamingDetokenizer:
        """A copy that shares no stream state and reports its reads to the template."""
        clone = object.__new__(StreamingDetokenizer)
        clone.__dict__.update(self.__dict__)
        clone._root = self._root if self._root is not None else self
        clone._aligner = copy.copy(self._aligner)
        clone.tokens = list(self.tokens)
        clone._text = list(self._text)
        clone._unread = list(self._unread)
        clone.segments = list(self.segments)
        clone._whole = copy.copy(self._whole)
        return clone

    def reset(self) -> None:
        # mlx-lm hands out shallow copies of one detokenizer, then resets them: take a
        # fresh aligner so that copies never share stream state.
        self._aligner = self._aligner.fresh()
        self.tokens: list[int] = []
        self.offset = 0
        self._text: list[str] = []
        self._length = 0
        self._unread: list[Segment] = []
        self.segments: list[Segment] = []
        self._open = self.drops_first_space  # no text yet, and a first space to drop
        self._whole = WholeTokens(self._aligner.vocab) if self.whole_tokens else None
        self._finished = False
        self.last_segment_tokens: list[TokenSpan] = []
        self.last_segment_spans: list[Segment] = []
        root = self._root
        if root is not None:  # a new stream starts: nothing of the old one is current
            root.last_segment_tokens = []
            root.last_segment_spans = []

    def _take(self, segments: list[Segment]) -> None:
        if self._open and segments:
            segments, self._open = drop_first_space(segments)
        for seg in segments:
            self._text.append(seg.text)
            self._length += len(seg.text)
            self._unread.append(seg)
            self.segments.append(seg)

    def add_token(self, token: Any, logprob: float | None = None, top_logprobs: Any = None) -> None:
        token = int(token)
        self.tokens.append(token)
        self._take(self._aligner.push(token, logprob, top_logprobs))

    def finalize(self) -> None:
        self._take(self._aligner.finish())
        self._finished = True

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    @property
    def last_segment(self) -> str:
        segments, self._unread = self._unread, []
        tokens = [t for seg in segments for t in seg.tokens]
        text = "".join(seg.text for seg in segments)
        if self._whole is not None:
            tokens, _ = self._whole.take(tokens, [], self._finished, bool(text))
        self.last_segment_spans = segments
        self.last_segment_tokens = tokens
        self.offset = self._length
        root = self._root
        if root is not None:  # mlx-lm reads a copy: let the installed template know
            root.last_segment_spans = segments
            root.last_segment_tokens = tokens
        return text


def mlx_lm_drops_first_space(tokenizer: Any) -> bool:
    """Whether mlx-lm's own streaming detokenizer for `tokenizer` drops a reply's first
    leading space: its `BPEStreamingDetokenizer` does, which `mlx_lm.tokenizer_utils.load`
    picks for a `tokenizer.json` whose decoder is ByteLevel (its SentencePiece and naive
    detokenizers give the tokenizer's decode)."""
    picked = getattr(tokenizer, "_detokenizer", None)  # an mlx-lm TokenizerWrapper's pick
    if isinstance(picked, StreamingDetokenizer):
        return picked.replaced_bpe
    if picked is not None:
        return type(picked).__name__ == "BPEStreamingDetokenizer"
    if isinstance(tokenizer, Aligner):
        tokenizer = tokenizer.vocab.source
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers fast tokenizer
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def install(
    target: Any,
    skip_special_tokens: bool = False,
    like_mlx_lm: bool = False,
    whole_tokens: bool = False,
) -> StreamingDetokenizer:
    """Make an mlx-lm TokenizerWrapper hand out tokentrail detokenizers; returns the
    template, which every copy mlx-lm takes of it reports its `last_segment` reads to.

    `target` is the wrapper, or an object holding it as `tokenizer` (an mlx-engine model
    kit): then a `detokenizer` it keeps to copy per request (`BatchedVisionModelKit`,
    `ModelKit`) is replaced by the template too. `like_mlx_lm=True` keeps mlx-lm's text
    (see the module's docstring); `whole_tokens`: see `StreamingDetokenizer`."""
    own = getattr(target, "__dict__", {})
    wrapper = own.get("tokenizer")
    if wrapper is None or not hasattr(wrapper, "_detokenizer"):
        wrapper, kit = target, None
    else:
        kit = target
    detok = StreamingDetokenizer(
        wrapper, skip_special_tokens, like_mlx_lm=like_mlx_lm, whole_tokens=whole_tokens
    )
    wrapper._detokenizer = detok
    if kit is not None and hasattr(kit, "detokenizer"):
        kit.detokenizer = detok
    return detok
