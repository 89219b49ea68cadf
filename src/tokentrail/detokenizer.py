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
"""

from __future__ import annotations

import copy
from typing import Any

from .align import Aligner
from .segment import Segment, TokenSpan


class StreamingDetokenizer:
    """mlx-lm's StreamingDetokenizer interface (`reset`, `add_token`, `finalize`, `text`,
    `tokens`, `offset`, `last_segment`) backed by the exact aligner.

    `last_segment` returns the text that became final since it was last read, as in
    mlx-lm; reading it also sets `last_segment_tokens` to the tokens behind exactly that
    text (each with index, id and the byte range it contributed), and
    `last_segment_spans` to the segments themselves.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self._aligner = (
            tokenizer
            if isinstance(tokenizer, Aligner)
            else Aligner(tokenizer, skip_special_tokens=skip_special_tokens)
        )
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
        self.last_segment_tokens: list[TokenSpan] = []
        self.last_segment_spans: list[Segment] = []
        root = self._root
        if root is not None:  # a new stream starts: nothing of the old one is current
            root.last_segment_tokens = []
            root.last_segment_spans = []

    def _take(self, segments: list[Segment]) -> None:
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

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    @property
    def last_segment(self) -> str:
        segments, self._unread = self._unread, []
        tokens = [t for seg in segments for t in seg.tokens]
        self.last_segment_spans = segments
        self.last_segment_tokens = tokens
        self.offset = self._length
        root = self._root
        if root is not None:  # mlx-lm reads a copy: let the installed template know
            root.last_segment_spans = segments
            root.last_segment_tokens = tokens
        return "".join(seg.text for seg in segments)


def install(tokenizer_wrapper: Any, skip_special_tokens: bool = False) -> StreamingDetokenizer:
    """Make an mlx-lm TokenizerWrapper hand out tokentrail detokenizers; returns the
    template, which every copy mlx-lm takes of it reports its `last_segment` reads to."""
    detok = StreamingDetokenizer(tokenizer_wrapper, skip_special_tokens=skip_special_tokens)
    tokenizer_wrapper._detokenizer = detok
    return detok
