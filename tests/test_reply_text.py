"""The reply's own text (`align_to_prompt=False`), whole tokens and `from_draft` spans,
checked token by token against mlx-lm's own streaming detokenizers (issue 20)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require

require("mlx_lm")

from tokentrail.detokenizer import StreamingDetokenizer, mlx_lm_drops_first_space  # noqa: E402
from tokentrail.engines.base import Step  # noqa: E402
from tokentrail.prompting import aligner_for, stop_matcher  # noqa: E402
from tokentrail.sequence import SequenceState  # noqa: E402

# (mlx-lm's naive detokenizer, which SentencePiece without a tokenizer.json gets, decodes
# each line on its own, so a line after "\n" that starts with a word loses its space;
# these replies keep to what every mlx-lm detokenizer agrees is the reply's text.)
REPLIES = [" hndet is here", "hndet", "  two spaces", " 🙂 ok done", "\nfirst", " ", "a ,b"]


def _wrapper(corpus: Path, tmp: Path, name: str) -> Any:
    from mlx_lm.tokenizer_utils import load

    folder = tmp / name
    folder.mkdir()
    if name == "gpt2":  # byte-level BPE: mlx-lm's BPEStreamingDetokenizer
        (folder / "tokenizer.json").symlink_to(corpus / "tokenizers/gpt2/tokenizer.json")
    else:  # SentencePiece through transformers: mlx-lm's naive detokenizer
        (folder / "tokenizer.model").symlink_to(corpus / "tokenizers/llama2/tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer", "legacy": True}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load(folder)


@pytest.fixture(params=["gpt2", "llama2"])
def wrapper(request: pytest.FixtureRequest, corpus: Path, tmp_path: Path) -> Any:
    return _wrapper(corpus, tmp_path, request.param)


def _mlx_lm_text(wrapper: Any, ids: list[int]) -> str:
    det = wrapper.detokenizer  # mlx-lm's own pick (nothing installed)
    out = ""
    for i in ids:
        det.add_token(i)
        out += det.last_segment
    det.finalize()
    return out + det.last_segment


def _responses(wrapper: Any, ids: list[int], **kw: Any) -> list[Any]:
    drafted = kw.pop("drafted", set())
    seq = SequenceState(
        aligner_for(wrapper, None, False), stop_matcher(kw.pop("stop", None)), frozenset(),
        0, len(ids), None, lambda: 0.0, drop_first_space=mlx_lm_drops_first_space(wrapper),
        **kw,
    )
    out = []
    for n, i in enumerate(ids):
        out.append(seq.feed(Step(i, -0.5, [], None, n in drafted)))
        if seq.done:
            break
    return out


def test_reply_text_is_mlx_lm_detokenizers_text(wrapper: Any) -> None:
    bpe = type(wrapper._detokenizer).__name__ == "BPEStreamingDetokenizer"
    assert mlx_lm_drops_first_space(wrapper) is bpe
    for reply in REPLIES:
        ids = wrapper.encode(reply, add_special_tokens=False)
        want = _mlx_lm_text(wrapper, ids)
        for whole in (False, True):
            got = _responses(wrapper, ids, whole_tokens=whole)
            assert "".join(r.text for r in got) == want, (reply, whole)
        drop_in = StreamingDetokenizer(wrapper, like_mlx_lm=True, whole_tokens=True)
        text = ""
        for i in ids:
            drop_in.add_token(i)
            text += drop_in.last_segment
        drop_in.finalize()
        assert text + drop_in.last_segment == want, reply
    if bpe:  # the case the issue names: mlx-lm drops the reply's first space
        assert _mlx_lm_text(wrapper, wrapper.encode(" is", add_special_tokens=False)) == "is"


def _check_whole(got: list[Any], ids: list[int]) -> None:
    listed = [t for r in got for t in r.last_segment_tokens] + got[-1].stop_tokens
    assert [t.index for t in listed] == list(range(len(got)))
    assert [t.id for t in listed] == ids[: len(got)]


def test_whole_tokens_lists_each_token_once_in_the_later_segment(wrapper: Any) -> None:
    for reply in ["a 🙂👍🏽 你好 done", "x é y", *REPLIES]:
        ids = wrapper.encode(reply, add_special_tokens=False)
        split = _responses(wrapper, ids)
        whole = _responses(wrapper, ids, whole_tokens=True)
        assert [r.text for r in whole] == [r.text for r in split], reply  # text unchanged
        _check_whole(whole, ids)
        last_seen: dict[int, int] = {}
        for n, r in enumerate(split):
            for t in r.last_segment_tokens:
                last_seen[t.index] = n
        for n, r in enumerate(whole):  # listed where its last bytes came out
            for t in r.last_segment_tokens:
                assert last_seen[t.index] == n, (reply, t)


def test_whole_tokens_with_a_held_stop_prefix_and_a_straddling_stop(wrapper: Any) -> None:
    ids = wrapper.encode("one two three four", add_special_tokens=False)
    for stop in ["thr", "hree f", "o t", "zzz", "e fo"]:
        split = _responses(wrapper, ids, stop=[stop])
        whole = _responses(wrapper, ids, stop=[stop], whole_tokens=True)
        assert [r.text for r in whole] == [r.text for r in split], stop
        _check_whole(whole, ids)
        if whole[-1].stop_string is not None:
            text = "".join(r.text for r in whole)
            assert text == _mlx_lm_text(wrapper, ids).split(stop)[0], stop
            in_text = {t.index for r in whole for t in r.last_segment_tokens}
            assert not in_text & {t.index for t in whole[-1].stop_tokens}


def test_from_draft_on_every_span(wrapper: Any) -> None:
    ids = wrapper.encode("a 🙂 b c d", add_special_tokens=False)
    drafted = {1, 2, 4}
    for whole in (False, True):
        got = _responses(wrapper, ids, whole_tokens=whole, drafted=set(drafted))
        spans = [t for r in got for t in r.last_segment_tokens]
        assert spans and all(t.from_draft == (t.index in drafted) for t in spans)
        assert [r.from_draft for r in got] == [n in drafted for n in range(len(got))]
