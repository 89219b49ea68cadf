"""A drop-in for mlx-lm's streaming detokenizers that also says which tokens made each
piece of text (`last_segment_tokens`), with exact text for every tokenizer family.

    from mlx_lm import load, stream_generate
    import tokentrail

    model, tokenizer = load("path/to/model")
    detok = tokentrail.detokenizer.install(tokenizer)   # replaces mlx-lm's pick
    for response in stream_generate(model, tokenizer, prompt):
        ...   # response.text is exact; see StreamingDetokenizer for the tokens

mlx-lm's `stream_generate` reads `last_segment` once per token; read
`last_segment_tokens` right after it to get the tokens behind that text.
"""

from __future__ import annotations

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
        self.reset()

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
        self.last_segment_spans = segments
        self.last_segment_tokens = [t for seg in segments for t in seg.tokens]
        self.offset = self._length
        return "".join(seg.text for seg in segments)


def install(tokenizer_wrapper: Any, skip_special_tokens: bool = False) -> StreamingDetokenizer:
    """Make an mlx-lm TokenizerWrapper hand out tokentrail detokenizers; returns the template."""
    detok = StreamingDetokenizer(tokenizer_wrapper, skip_special_tokens=skip_special_tokens)
    tokenizer_wrapper._detokenizer = detok
    return detok
