"""The server's reasoning format and a constraint: `structured.bound` gates the
constraint after the format's end markers, and `structure_options` refuses a constraint
the caller bound without them (never a mask that starts before the reasoning ends).
Real llguidance and Qwen2's tokenizer from the corpus."""

from __future__ import annotations

import pytest

from tests.helpers.env import CORPUS, require

require("llguidance", "constraints compile through llguidance")
transformers = require("transformers")

from tokentrail.constrain import constraint_from  # noqa: E402
from tokentrail.errors import APIError  # noqa: E402
from tokentrail.server.structured import Structure, bound, structure_options  # noqa: E402
from tokentrail.structure import ChannelSplitter, reasoning_format  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(CORPUS / "tokenizers" / "qwen2"))


def test_the_servers_format_gates_the_constraint(tok) -> None:
    qwen3 = reasoning_format("qwen3")
    structure = Structure(constraint=constraint_from(json_object=True))
    assert bound(structure, tok).after == ()
    assert bound(structure, tok, qwen3).after == ("</think>",)
    assert bound(structure, tok, qwen3, chat=False).after == ()  # completions: no split
    granite = reasoning_format("granite")  # starts as content: the mask starts at once
    assert bound(structure, tok, granite).after == ()
    with pytest.raises(APIError) as e:
        structure_options(structure, qwen3, True, lambda ids: None)
    assert e.value.status == 400 and e.value.param == "response_format"
    options = structure_options(structure, qwen3, True, lambda ids: None, gated=True)
    assert ChannelSplitter(options["reasoning"]).channel == "reasoning"


def test_the_requests_own_format_needs_no_hook(tok) -> None:
    own = Structure(
        constraint=constraint_from(json_object=True), reasoning=reasoning_format(("", "END"))
    )
    assert bound(own, tok).after == ("END",)
    assert structure_options(own, None, True, lambda ids: None)["reasoning"] is not None
    off = Structure(constraint=constraint_from(json_object=True), reasoning=False)
    assert bound(off, tok, reasoning_format("qwen3")).after == ()
    # fields (a JSON constraint) keep the output stage on, with no reasoning split
    options = structure_options(off, reasoning_format("qwen3"), True, lambda ids: None)
    assert options["fields"] and options["reasoning"] is None
