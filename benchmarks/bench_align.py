"""Streaming-detokenizer benchmark: tokentrail's Aligner against the detokenizers people use.

Side by side in one run, on the same token-id streams, for each tokenizer:

- tokentrail `Aligner(path).push(id)` / `finish()` (on the tokenizer's native file and,
  where that differs, on the tokenizer.json the peers use),
- the streaming detokenizer mlx-lm picks for that tokenizer.json
  (`mlx_lm.tokenizer_utils.load(folder).detokenizer`: SPM, BPE or Naive),
- tokenizers' `DecodeStream(skip_special_tokens=False)`,
- transformers' `TextIteratorStreamer`, fed one `torch` tensor per step as `generate()` does.

Two streams per tokenizer: real multilingual prose and code (Python's own docs from
`pydoc_data.topics` interleaved with paragraphs written for this benchmark) encoded to
20k tokens, and the same text with newlines replaced by spaces, encoded to 64k tokens
(a single line: detokenizers that re-decode since the last newline go quadratic there).

Reported per approach: µs/token (median of repeats), the cost on the first 1k/4k/16k/64k
tokens of the single-line stream, holdback (tokens that arrive after a token before all
its bytes are out) against the minimum possible, and whether the concatenated output
equals the tokenizer's own decode. Run `python benchmarks/bench_align.py --help`.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus" / "tokenizers"
RESULTS = REPO / "benchmarks" / "results"
BLOCK = 250  # tokens between clock reads; every checkpoint is a multiple of it
CHECKPOINTS = (1000, 4000, 16000, 64000)

log = logging.getLogger("bench_align")

# -- the text --------------------------------------------------------------------------

#: Paragraphs written for this benchmark (free to redistribute with it): many scripts,
#: emoji with modifiers and joiners, symbols, and code with tabs.
MULTILINGUAL: tuple[str, ...] = (
    "Streaming text one token at a time sounds simple until a single emoji 👩🏽‍💻 spans "
    "several tokens and a flag 🇫🇷 is two characters. Tabs\tand  double  spaces survive a "
    "round trip; so do “curly quotes”, em—dashes, non‑breaking hyphens and the ellipsis…",
    "Le café du coin ouvre à sept heures ; on y lit le journal, on y parle de la pluie et du "
    "beau temps, et l’on repart avant que la file d’attente ne s’allonge. Déjà vu, naïveté, "
    "cœur, où, Noël, garçon.",
    "Die Straßenbahn fährt über die Brücke, während die Möwen über dem Fluss kreisen. "
    "Größere Städte haben längere Nächte, aber kürzere Wege; übermorgen wird es wärmer.",
    "El niño pidió una canción más antes de dormir; la abuela, cansada pero feliz, cantó en "
    "voz baja. A ação começa às três horas, não às quatro — não se atrase!",
    "Поезд опаздывал на двадцать минут, и пассажиры спокойно пили чай у окна. Ёлка, щука, "
    "съезд, объём: буквы, которые любят токенизаторы.",
    "Η θάλασσα ήταν ήρεμη το πρωί και οι ψαράδες γύρισαν νωρίς στο λιμάνι. Ψυχή, ωκεανός, "
    "ἀρχή, ὁδός.",
    "今天早上下了一场小雨，街道两旁的树叶显得格外翠绿。我们在图书馆里读书，讨论了流式解码"
    "的难点：一个汉字可能被切成好几个字节，而每个字节都可能属于不同的词元。",
    "駅前のパン屋さんは朝六時に開きます。カタカナ、ひらがな、漢字が混ざった文章は、"
    "トークナイザーにとって良い試験になります。",
    "아침에 커피를 마시면서 뉴스를 읽었습니다. 한글은 음절 단위로 조합되지만, 바이트 "
    "단위로 보면 한 글자가 세 바이트입니다.",
    "ذهبنا إلى السوق في الصباح واشترينا الخبز والزيتون. الأرقام العربية الهندية: "
    "٠١٢٣٤٥٦٧٨٩، والكتابة من اليمين إلى اليسار.",
    "הספרייה נפתחת בשעה תשע בבוקר, והקוראים מגיעים מוקדם כדי לתפוס מקום ליד החלון.",
    "सुबह की ठंडी हवा में हम नदी के किनारे टहलने गए। देवनागरी में मात्राएँ और संयुक्ताक्षर जैसे क्ष, त्र और ज्ञ होते हैं।",
    "ฝนตกหนักเมื่อคืนนี้ แต่เช้านี้ท้องฟ้าแจ่มใส นักเรียนเดินไปโรงเรียนพร้อมกัน",
    "Buổi sáng ở Hà Nội, người ta uống cà phê trứng và ngắm phố cổ. Tiếng Việt có nhiều "
    "dấu thanh: à, á, ả, ã, ạ.",
    "Math and symbols: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ ≤ ∞; ≈ ≠ ± × ÷ √ ∫ ∂. Arrows ← → ↔ ⇒; "
    "currency € £ ¥ ₹ ₩; emoji 🙂 👍🏽 🎉 🧪 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇧🇷.",
    "def moving_average(values: list[float], window: int = 3) -> list[float]:\n"
    '\t"""Return the trailing mean of `values` over `window` items."""\n'
    "\tout = []\n"
    "\tfor i in range(len(values)):\n"
    "\t\tlo = max(0, i - window + 1)\n"
    "\t\tout.append(sum(values[lo : i + 1]) / (i + 1 - lo))\n"
    "\treturn out\n\n"
    '{"name": "Zoë", "city": "Zürich", "tags": ["naïve", "résumé"], "ok": true, "n": 3.14}',
)


def documents() -> list[str]:
    """Python's reference-manual topics interleaved with the multilingual paragraphs."""
    from pydoc_data.topics import topics

    docs: list[str] = []
    for i, key in enumerate(sorted(topics)):
        docs.append(topics[key].strip())
        docs.append(MULTILINGUAL[i % len(MULTILINGUAL)])
    return docs


def build_stream(encode: Callable[[str], list[int]], text: str, n_tokens: int) -> list[int]:
    """Encode `text` (repeated if needed) and cut to exactly `n_tokens` ids."""
    ids = encode(text)
    if not ids:
        raise ValueError("the tokenizer encoded the benchmark text to no tokens")
    out = list(ids)
    while len(out) < n_tokens:
        out.extend(ids)
    return out[:n_tokens]


# -- tokenizers ------------------------------------------------------------------------


@dataclass
class Case:
    """One tokenizer: the tokenizer.json folder the peers load, and tokentrail's sources."""

    key: str
    label: str
    kind: str
    folder: Path
    sources: list[tuple[str, Path]]


def _link(dst_dir: Path, files: dict[str, Path]) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        if not src.is_file():
            raise FileNotFoundError(f"corpus file missing: {src}")
        target = dst_dir / name
        if not target.exists():
            target.symlink_to(src)
    return dst_dir


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def _convert(src_dir: Path, dst: Path) -> Path:
    """Let transformers convert a folder (e.g. a SentencePiece .model) to tokenizer.json."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(src_dir)).save_pretrained(str(dst))
    if not (dst / "tokenizer.json").is_file():
        raise RuntimeError(f"transformers wrote no tokenizer.json for {src_dir}")
    return dst


def _llama3(work: Path) -> Path:
    """Llama 3's tiktoken ranks, converted by transformers' TikTokenConverter."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from tokentrail.vocab.tiktoken_ranks import _LLAMA3_PAT, tiktoken_specials

    specials = list(tiktoken_specials(128000))
    conv = TikTokenConverter(
        vocab_file=str(CORPUS / "llama3" / "tokenizer.model"),
        pattern=_LLAMA3_PAT,
        extra_special_tokens=specials,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=conv.converted(),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )
    dst = work / "llama3"
    tok.save_pretrained(str(dst))
    return dst


def prepare_cases(work: Path, only: set[str] | None) -> list[Case]:
    """Build every tokenizer folder the peers need (in `work`), from the shared corpus."""
    c = CORPUS
    specs: list[tuple[str, str, str, Callable[[], tuple[Path, list[tuple[str, Path]]]]]] = []

    def gpt2() -> tuple[Path, list[tuple[str, Path]]]:
        d = _link(work / "gpt2", {"tokenizer.json": c / "gpt2" / "tokenizer.json"})
        _write_json(d / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
        return d, [("tokenizer.json", c / "gpt2" / "tokenizer.json")]

    def qwen2() -> tuple[Path, list[tuple[str, Path]]]:
        src = _link(work / "qwen2-src", {p.name: p for p in (c / "qwen2").iterdir()})
        d = _convert(src, work / "qwen2")
        return d, [("vocab.json+merges.txt", c / "qwen2"), ("tokenizer.json", d / "tokenizer.json")]

    def llama3() -> tuple[Path, list[tuple[str, Path]]]:
        d = _llama3(work)
        return d, [
            ("tiktoken", c / "llama3" / "tokenizer.model"),
            ("tokenizer.json", d / "tokenizer.json"),
        ]

    def spm(sub: str, model: str, link_as: str, cfg: dict[str, Any] | None = None) -> Any:
        def make() -> tuple[Path, list[tuple[str, Path]]]:
            src = _link(work / f"{sub}-src", {link_as: c / model})
            if cfg:
                _write_json(src / "tokenizer_config.json", cfg)
            d = _convert(src, work / sub)
            return d, [(Path(model).name, c / model), ("tokenizer.json", d / "tokenizer.json")]

        return make

    def pegasus() -> tuple[Path, list[tuple[str, Path]]]:
        d = _link(work / "pegasus", {p.name: p for p in (c / "pegasus").iterdir()})
        return d, [("tokenizer.json", c / "pegasus" / "tokenizer.json")]

    specs = [
        ("gpt2", "GPT-2", "byte-level BPE", gpt2),
        ("qwen2", "Qwen2", "byte-level BPE", qwen2),
        ("llama3", "Llama 3", "byte-level BPE (tiktoken)", llama3),
        (
            "llama2",
            "Llama 2",
            "SentencePiece BPE",
            spm("llama2", "llama2/tokenizer.model", "tokenizer.model"),
        ),
        (
            "mistral1",
            "Mistral v1",
            "SentencePiece BPE",
            spm("mistral1", "mistral/tokenizer.model.v1", "tokenizer.model"),
        ),
        (
            "t5",
            "T5 (legal)",
            "Metaspace Unigram",
            spm("t5", "t5/spiece.model", "spiece.model", {"tokenizer_class": "T5Tokenizer"}),
        ),
        ("pegasus", "Pegasus", "Metaspace Unigram", pegasus),
    ]
    cases = []
    for key, label, kind, make in specs:
        if only and key not in only:
            continue
        folder, sources = make()
        cases.append(Case(key, label, kind, folder, sources))
    return cases


# -- approaches ------------------------------------------------------------------------


class Approach:
    """A streaming detokenizer under test, driven one token at a time.

    `run_block` is the timed loop: it feeds items and appends every non-empty text the
    detokenizer hands out. `run_traced` does the same and also records at which step each
    text came out (and, for tokentrail, which tokens each segment lists).
    """

    name = "?"
    detail = ""
    attribution = False
    setup_ms: float | None = 0.0

    def prepare(self, ids: list[int]) -> list[Any]:
        return ids

    def reset(self) -> None:
        raise NotImplementedError

    def run_block(self, items: Sequence[Any], out: list[str]) -> None:
        raise NotImplementedError

    def run_traced(self, items: Sequence[Any], k0: int, events: list[Any]) -> None:
        raise NotImplementedError

    def flush(self) -> str:
        raise NotImplementedError

    def reference(self, ids: list[int]) -> str:
        raise NotImplementedError


class TokentrailApproach(Approach):
    attribution = True

    def __init__(self, source_label: str, path: Path) -> None:
        from tokentrail import Aligner

        t0 = time.perf_counter()
        self.aligner = Aligner(path)
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.name = f"tokentrail ({source_label})"
        self.detail = f"Aligner({path.name}), byte_mode={self.aligner.vocab.byte_mode}"
        if self.aligner.vocab.generic is not None:
            self.detail += ", generic re-decode path"

    def reset(self) -> None:
        self.aligner.reset()

    def run_block(self, items: Sequence[Any], out: list[str]) -> None:
        push = self.aligner.push
        app = out.append
        for t in items:
            for seg in push(t):
                app(seg.text)

    def run_traced(self, items: Sequence[Any], k0: int, events: list[Any]) -> None:
        push = self.aligner.push
        for k, t in enumerate(items, k0 + 1):
            for seg in push(t):
                events.append((k, seg.text, [s.index for s in seg.tokens]))

    def flush(self) -> str:
        return "".join(s.text for s in self.aligner.finish())

    def flush_traced(self, k: int, events: list[Any]) -> None:
        for seg in self.aligner.finish():
            events.append((k, seg.text, [s.index for s in seg.tokens]))

    def reference(self, ids: list[int]) -> str:
        return self.aligner.vocab.decode(ids, False)


class TokensReadApproach(TokentrailApproach):
    """tokentrail with every segment's tokens read (index, id, byte range, logprob): the
    product, since the attribution is what the peers do not give."""

    def __init__(self, source_label: str, path: Path) -> None:
        super().__init__(source_label, path)
        self.name = f"tokentrail ({source_label}, tokens read)"

    def run_block(self, items: Sequence[Any], out: list[str]) -> None:
        push = self.aligner.push
        app = out.append
        sink = 0
        for t in items:
            for seg in push(t):
                app(seg.text)
                for span in seg.tokens:
                    sink += span.index + span.id + span.end - span.start
                    span.logprob  # noqa: B018
        self.sink = sink


def priming(aligner: Any, ids: list[int], reps: int) -> dict[str, Any]:
    """A 4k-token prompt given as `prompt_ids` vs aligning the same tokens (tokens read).

    Both build a fresh stream over the same compiled tables; medians of `reps` runs.
    """
    prompt = ids[:4000]

    def prime() -> None:
        aligner.fresh(prompt_ids=prompt)

    def align() -> None:
        a = aligner.fresh(prompt_ids=None)
        push = a.push
        for t in prompt:
            for seg in push(t):
                for span in seg.tokens:
                    span.index  # noqa: B018
        a.finish()

    out: dict[str, Any] = {"prompt_tokens": len(prompt)}
    for label, fn in (("prime_ms", prime), ("align_ms", align)):
        runs = []
        for _ in range(reps):
            gc.collect()
            t0 = time.perf_counter_ns()
            fn()
            runs.append((time.perf_counter_ns() - t0) / 1e6)
        out[label] = statistics.median(runs)
        out[label + "_runs"] = runs
    out["ratio"] = out["prime_ms"] / out["align_ms"]
    return out


class MlxApproach(Approach):
    def __init__(self, folder: Path) -> None:
        from mlx_lm.tokenizer_utils import load

        t0 = time.perf_counter()
        self.wrapper = load(folder)
        self.det = self.wrapper.detokenizer
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.name = f"mlx-lm {type(self.det).__name__.replace('StreamingDetokenizer', '')}"
        self.detail = (
            f"mlx_lm.tokenizer_utils.load(folder).detokenizer -> {type(self.det).__name__}"
        )
        if getattr(self.det, "trim_space", True) is False:
            self.detail += "(trim_space=False)"
        self.hf = self.wrapper._tokenizer

    def reset(self) -> None:
        self.det = self.wrapper.detokenizer  # a reset copy, as stream_generate gets

    def run_block(self, items: Sequence[Any], out: list[str]) -> None:
        det = self.det
        add = det.add_token
        app = out.append
        for t in items:
            add(t)
            seg = det.last_segment
            if seg:
                app(seg)

    def run_traced(self, items: Sequence[Any], k0: int, events: list[Any]) -> None:
        det = self.det
        for k, t in enumerate(items, k0 + 1):
            det.add_token(t)
            seg = det.last_segment
            if seg:
                events.append((k, seg, None))

    def flush(self) -> str:
        self.det.finalize()
        return self.det.last_segment

    def reference(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


class DecodeStreamApproach(Approach):
    name = "tokenizers DecodeStream"

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        t0 = time.perf_counter()
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.detail = "DecodeStream(skip_special_tokens=False).step(tokenizer, id); no flush"

    def reset(self) -> None:
        from tokenizers.decoders import DecodeStream

        self.ds = DecodeStream(skip_special_tokens=False)

    def run_block(self, items: Sequence[Any], out: list[str]) -> None:
        step = self.ds.step
        tok = self.tok
        app = out.append
        for t in items:
            s = step(tok, t)
            if s:
                app(s)

    def run_traced(self, items: Sequence[Any], k0: int, events: list[Any]) -> None:
        step = self.ds.step
        for k, t in enumerate(items, k0 + 1):
            s = step(self.tok, t)
            if s:
                events.append((k, s, None))

    def flush(self) -> str:
        return ""  # DecodeStream has no flush: an unfinished character stays unsaid

    def reference(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


class StreamerApproach(Approach):
    name = "transformers TextIteratorStreamer"
    setup_ms = None  # shares the transformers tokenizer mlx-lm loaded

    def __init__(self, hf_tokenizer: Any) -> None:
        import torch
        from transformers import TextIteratorStreamer

        self.torch = torch
        self.cls = TextIteratorStreamer
        self.hf = hf_tokenizer
        self.detail = (
            "TextIteratorStreamer(tokenizer).put(torch.tensor([id])), queue drained after "
            "each put; end() flushes"
        )

    def prepare(self, ids: list[int]) -> list[Any]:
        # generate() hands put() a tensor it already has; build them outside the clock.
        return [self.torch.tensor([i]) for i in ids]

    def reset(self) -> None:
        self.st = self.cls(self.hf)

    def run_block(self, items: Sequence[Any], out: list[str]) -> None:
        put = self.st.put
        get = self.st.text_queue.get_nowait
        app = out.append
        for x in items:
            put(x)
            s = get()
            if s:
                app(s)

    def run_traced(self, items: Sequence[Any], k0: int, events: list[Any]) -> None:
        put = self.st.put
        get = self.st.text_queue.get_nowait
        for k, x in enumerate(items, k0 + 1):
            put(x)
            s = get()
            if s:
                events.append((k, s, None))

    def flush(self) -> str:
        self.st.end()
        q = self.st.text_queue
        parts = []
        while not q.empty():
            s = q.get_nowait()
            if s is self.st.stop_signal:
                break
            parts.append(s)
        return "".join(parts)

    def reference(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


# -- running ---------------------------------------------------------------------------


@dataclass
class Run:
    """One pass of an approach over a stream."""

    n_done: int
    total_ns: int
    cum_ns: list[int]  # cumulative ns after each BLOCK
    stopped: bool
    text: str = ""
    events: list[Any] = field(default_factory=list)


def run_once(ap: Approach, items: list[Any], budget_s: float, traced: bool) -> Run:
    """Feed `items` in blocks, reading the clock between blocks; stop past the budget."""
    ap.reset()
    gc.collect()
    gc.freeze()  # collections during the run walk only what the run itself allocates
    try:
        return _run_once(ap, items, budget_s, traced)
    finally:
        gc.unfreeze()


def _run_once(ap: Approach, items: list[Any], budget_s: float, traced: bool) -> Run:
    out: list[str] = []
    events: list[Any] = []
    budget_ns = int(budget_s * 1e9)
    total = 0
    cum: list[int] = []
    n = len(items)
    n_done = 0
    stopped = False
    clock = time.perf_counter_ns
    for a in range(0, n, BLOCK):
        blk = items[a : a + BLOCK]
        t0 = clock()
        if traced:
            ap.run_traced(blk, a, events)
        else:
            ap.run_block(blk, out)
        total += clock() - t0
        cum.append(total)
        n_done = a + len(blk)
        if total > budget_ns and n_done < n:
            stopped = True
            break
    t0 = clock()
    if traced and isinstance(ap, TokentrailApproach):
        ap.flush_traced(n_done + 1, events)
    else:
        tail = ap.flush()
        if traced and tail:
            events.append((n_done + 1, tail, None))
        out.append(tail)
    total += clock() - t0
    text = "".join(e[1] for e in events) if traced else "".join(out)
    return Run(n_done, total, cum, stopped, text, events)


# -- analysis --------------------------------------------------------------------------


def _char_starts(data: bytes) -> list[int]:
    return [p for p, b in enumerate(data) if b & 0xC0 != 0x80]


def _utf8_final(data: bytes, end: int) -> int:
    """The largest position <= end before which `data` holds only complete characters."""
    for j in range(end - 1, max(-1, end - 4), -1):
        b = data[j]
        if b & 0xC0 == 0x80:
            continue
        need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
        return j if b >= 0xC0 and j + need > end else end
    return end


@dataclass
class ByteModel:
    """Per-token byte ends in the reference text, and the minimum-holdback steps.

    Built from the Vocab's byte pieces and checked against the reference decode: the
    pieces, joined and decoded, must give the reference text (after the leading spaces
    a Strip rule removes), else the stream is reported without holdback figures.
    """

    cend: list[int]  # chars of the reference text that cover token i's bytes
    ideal_utf8: list[int]  # earliest step with token i's bytes final (incomplete UTF-8 held)
    ideal_exact: list[int]  # the same when byte-fallback runs must also be complete
    n_chars: int


def byte_model(vocab: Any, ids: list[int], ref: str) -> tuple[ByteModel | None, str]:
    pieces = vocab.pieces
    chunks: list[bytes] = []
    first = True
    for t in ids:
        p = pieces[t] or b""
        if first and t not in vocab.hidden and p:
            p = vocab.first_pieces.get(t, p)
            first = False
        chunks.append(p)
    data = b"".join(chunks)
    starts = _char_starts(data)
    text = data.decode("utf-8", "replace")
    if len(text) != len(starts):
        return None, "byte model: invalid UTF-8 inside the stream"
    skip = len(text) - len(ref)
    if skip < 0 or text[skip:] != ref or text[:skip].strip(" "):
        return None, "byte model does not reproduce the reference decode"
    n = len(ids)
    ends = []
    pos = 0
    for p in chunks:
        pos += len(p)
        ends.append(pos)
    cend = [max(0, bisect.bisect_left(starts, e) - skip) for e in ends]
    hf_runs = vocab.byte_mode == "hf_runs"
    run_start = 0
    fin_u: list[int] = []
    fin_x: list[int] = []
    prev = 0
    for i, t in enumerate(ids):
        u = _utf8_final(data, ends[i])
        fin_u.append(max(0, bisect.bisect_left(starts, u) - skip))
        if hf_runs and t in vocab.byte_ids:
            if i == 0 or ids[i - 1] not in vocab.byte_ids:
                run_start = prev
            x = min(u, run_start)
        else:
            x = u
        fin_x.append(max(0, bisect.bisect_left(starts, x) - skip))
        prev = ends[i]

    def steps(final_chars: list[int]) -> list[int]:
        out = []
        k = 0  # final_chars[k] is the coverage after step k + 1
        for i in range(n):
            k = max(k, i)
            while k < n and final_chars[k] < cend[i]:
                k += 1
            out.append(k + 1)  # k == n means "at finish", step n + 1
        return out

    return ByteModel(cend, steps(fin_u), steps(fin_x), len(ref)), ""


def emission_steps_by_length(events: list[Any], cend: list[int], n: int) -> list[int]:
    """Step at which the emitted text first reaches each token's last character."""
    lengths = [0] * (n + 2)
    for k, text, _ in events:
        lengths[min(k, n + 1)] += len(text)
    for k in range(1, n + 2):
        lengths[k] += lengths[k - 1]
    out = []
    k = 1
    for i in range(n):
        k = max(k, i + 1)
        while k <= n and lengths[k] < cend[i]:
            k += 1
        out.append(k)
    return out


def emission_steps_by_attribution(events: list[Any], n: int) -> list[int]:
    """Step of the last segment that lists each token (its last bytes went out then)."""
    last = [n + 1] * n
    seen = [False] * n
    for k, _, indices in events:
        for i in indices:
            if 0 <= i < n:
                last[i] = k
                seen[i] = True
    return last


def _pct(values: list[int], q: float) -> int:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def holdback_stats(steps: list[int], model: ByteModel) -> dict[str, Any]:
    h = [s - (i + 1) for i, s in enumerate(steps)]
    hu = [s - (i + 1) for i, s in enumerate(model.ideal_utf8)]
    hx = [s - (i + 1) for i, s in enumerate(model.ideal_exact)]
    eu = [a - b for a, b in zip(h, hu, strict=True)]
    ex = [a - b for a, b in zip(h, hx, strict=True)]
    return {
        "tokens": len(h),
        "mean": statistics.fmean(h),
        "p99": _pct(h, 0.99),
        "max": max(h),
        "min_utf8_mean": statistics.fmean(hu),
        "min_utf8_max": max(hu),
        "min_exact_mean": statistics.fmean(hx),
        "min_exact_max": max(hx),
        "excess_utf8_mean": statistics.fmean(eu),
        "excess_utf8_max": max(eu),
        "excess_exact_mean": statistics.fmean(ex),
        "excess_exact_max": max(ex),
        "tokens_over_utf8_min": sum(1 for e in eu if e > 0),
        "tokens_at_finish": sum(1 for s in steps if s == len(steps) + 1),
        "_h": h,
        "_eu": eu,
        "_ex": ex,
        "_hu": hu,
        "_hx": hx,
    }


def diff_chars(a: str, b: str) -> int:
    """Characters outside the common prefix and suffix (0 when equal)."""
    if a == b:
        return 0
    p = 0
    m = min(len(a), len(b))
    while p < m and a[p] == b[p]:
        p += 1
    s = 0
    while s < m - p and a[-1 - s] == b[-1 - s]:
        s += 1
    return max(len(a), len(b)) - p - s


def first_difference(a: str, b: str) -> str:
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    return f"at char {p}: got {a[p : p + 12]!r}, decode() has {b[p : p + 12]!r}"


# -- the benchmark ---------------------------------------------------------------------


@dataclass
class Config:
    text_tokens: int
    line_tokens: int
    reps: int
    budget_s: float
    only: set[str] | None
    out_dir: Path | None


def bench_case(case: Case, cfg: Config, docs: list[str]) -> dict[str, Any]:
    from tokenizers import Tokenizer

    log.info("== %s (%s)", case.label, case.kind)
    enc_tok = Tokenizer.from_file(str(case.folder / "tokenizer.json"))

    def encode(s: str) -> list[int]:
        return enc_tok.encode(s, add_special_tokens=False).ids

    streams = {
        "text": build_stream(encode, "\n\n".join(docs), cfg.text_tokens),
        "line": build_stream(encode, " ".join(d.replace("\n", " ") for d in docs), cfg.line_tokens),
    }
    approaches: list[Approach] = [TokentrailApproach(lbl, p) for lbl, p in case.sources]
    approaches += [TokensReadApproach(lbl, p) for lbl, p in case.sources]
    mlx = MlxApproach(case.folder)
    approaches += [mlx, DecodeStreamApproach(case.folder)]
    try:
        approaches.append(StreamerApproach(mlx.hf))
    except ImportError as e:  # torch missing: say so rather than silently drop it
        log.warning("TextIteratorStreamer skipped: %s", e)

    # The byte model for holdback: tokentrail's vocab of the same file, checked per stream.
    json_vocab = next(
        (
            a.aligner.vocab
            for a in approaches
            if isinstance(a, TokentrailApproach) and a.name.endswith("(tokenizer.json)")
        ),
        None,
    )
    if json_vocab is None:
        from tokentrail import load_vocab

        json_vocab = load_vocab(case.folder / "tokenizer.json")

    result: dict[str, Any] = {
        "key": case.key,
        "label": case.label,
        "kind": case.kind,
        "folder_decoder": json.loads((case.folder / "tokenizer.json").read_text())["decoder"],
        "approaches": {},
    }
    result["priming"] = {
        ap.name.removeprefix("tokentrail (").removesuffix(")"): priming(
            ap.aligner, streams["text"], max(cfg.reps, 3)
        )
        for ap in approaches
        if type(ap) is TokentrailApproach
    }
    for ap in approaches:
        result["approaches"][ap.name] = {
            "detail": ap.detail,
            "setup_ms": None if ap.setup_ms is None else round(ap.setup_ms, 1),
            "streams": {},
        }
    for sname, ids in streams.items():
        log.info("   stream %s: %d tokens", sname, len(ids))
        items = {ap.name: ap.prepare(ids) for ap in approaches}
        timings: dict[str, list[Run]] = {ap.name: [] for ap in approaches}
        # Pass 0: traced (holdback, exactness). A run that hits the budget here is not
        # repeated; its timing (trace overhead is negligible next to its cost) is used.
        for ap in approaches:
            run = run_once(ap, items[ap.name], cfg.budget_s, traced=True)
            entry = analyse(ap, ids, run, json_vocab)
            if run.stopped:
                timings[ap.name].append(run)
            result["approaches"][ap.name]["streams"][sname] = entry
            log.info("     %-42s %s", ap.name, _short(entry))
        for _ in range(cfg.reps):
            for ap in approaches:  # interleaved, so machine noise hits everyone alike
                if timings[ap.name] and timings[ap.name][0].stopped:
                    continue
                timings[ap.name].append(run_once(ap, items[ap.name], cfg.budget_s, False))
        for ap in approaches:
            runs = timings[ap.name]
            entry = result["approaches"][ap.name]["streams"][sname]
            entry.update(timing_summary(runs))
        del items
    _MODELS.clear()
    return result


def _short(entry: dict[str, Any]) -> str:
    hb = entry.get("holdback")
    hbs = "n/a" if not hb else f"hold {hb['mean']:.3f}/{hb['p99']}/{hb['max']}"
    ok = "exact" if entry["exact"] else f"MISMATCH {entry['diff_chars']} chars"
    stop = f" stopped after {entry['n_done']}" if entry["stopped"] else ""
    return f"{hbs} {ok}{stop}"


#: Byte models already built: (id(vocab), tokens) -> (reference, model, why, vocab).
_MODELS: dict[tuple[int, int], tuple[str, ByteModel | None, str, Any]] = {}


def analyse(ap: Approach, ids: list[int], run: Run, vocab: Any) -> dict[str, Any]:
    """Exactness against the approach's own reference decode, and holdback."""
    done = ids[: run.n_done]
    ref = ap.reference(done)
    entry: dict[str, Any] = {
        "n_tokens": len(ids),
        "n_done": run.n_done,
        "stopped": run.stopped,
        "exact": run.text == ref,
        "diff_chars": diff_chars(run.text, ref),
        "ref_chars": len(ref),
    }
    if not entry["exact"]:
        entry["first_difference"] = first_difference(run.text, ref)
    own_vocab = ap.aligner.vocab if isinstance(ap, TokentrailApproach) else vocab
    key = (id(own_vocab), run.n_done)
    hit = _MODELS.get(key)
    if hit is None or hit[0] != ref or hit[3] is not own_vocab:
        hit = (ref, *byte_model(own_vocab, done, ref), own_vocab)
        _MODELS[key] = hit
    model, why = hit[1], hit[2]
    if model is None:
        entry["holdback"] = None
        entry["holdback_note"] = why
        return entry
    n = len(done)
    by_len = emission_steps_by_length(run.events, model.cend, n)
    if ap.attribution:
        steps = emission_steps_by_attribution(run.events, n)
        entry["holdback_by_text_length_equal"] = steps == by_len
    else:
        steps = by_len
    entry["holdback"] = holdback_stats(steps, model)
    return entry


def timing_summary(runs: list[Run]) -> dict[str, Any]:
    """Median whole-stream cost, cumulative cost at each checkpoint, and block medians.

    The block figures (median over every 250-token block of every pass) shrug off the
    moments another process holds the CPU, which on a shared machine can add
    milliseconds to a few blocks; they show the steady cost per token and, per window
    between checkpoints, whether it grows along the stream.
    """
    us = [r.total_ns / r.n_done / 1e3 for r in runs]
    out: dict[str, Any] = {
        "us_per_token": statistics.median(us),
        "us_per_token_runs": us,
        "us_per_token_min": min(us),
    }
    blocks: list[list[float]] = []  # per pass: µs/token of each block
    for r in runs:
        prev = 0
        costs = []
        for cum in r.cum_ns:
            costs.append((cum - prev) / BLOCK / 1e3)
            prev = cum
        blocks.append(costs)
    out["us_per_token_steady"] = statistics.median(c for b in blocks for c in b)
    cps: dict[str, float] = {}
    local: dict[str, float] = {}
    lo = 0
    for cp in CHECKPOINTS:
        idx = cp // BLOCK - 1
        vals = [r.cum_ns[idx] / cp / 1e3 for r in runs if idx < len(r.cum_ns)]
        window = [c for b in blocks for c in b[lo // BLOCK : cp // BLOCK]]
        if vals:
            cps[str(cp)] = statistics.median(vals)
        if window and vals:
            local[str(cp)] = statistics.median(window)
        lo = cp
    out["us_per_token_first"] = cps
    out["us_per_token_window"] = local
    return out


# -- reporting -------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in (
        "tokentrail",
        "tokenizers",
        "transformers",
        "mlx_lm",
        "mlx",
        "torch",
        "sentencepiece",
        "tiktoken",
    ):
        try:
            m = __import__(mod)
            out[mod] = str(getattr(m, "__version__", "?"))
        except Exception as e:  # report, never fail, on a missing optional library
            out[mod] = f"unavailable ({type(e).__name__})"
    with contextlib.suppress(Exception):
        import mlx.core as mx

        out["mlx"] = mx.__version__
    return out


def machine() -> dict[str, Any]:
    model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _cost(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "–"
    return f"{_fmt(entry['us_per_token'])} ({_fmt(entry['us_per_token_steady'])})"


def _windows() -> list[str]:
    out, lo = [], 0
    for cp in CHECKPOINTS:
        out.append(f"{lo // 1000}–{cp // 1000}k")
        lo = cp
    return out


def _flat(entry: dict[str, Any]) -> str | None:
    """Last window's block median over the first's (the last window reached)."""
    win = entry["us_per_token_window"]
    reached = [win[str(cp)] for cp in CHECKPOINTS if str(cp) in win]
    return f"{reached[-1] / reached[0]:.2f}" if len(reached) > 1 and reached[0] else None


def _load(avg: Sequence[float] | None) -> str:
    return "?" if not avg else "/".join(f"{x:.1f}" for x in avg)


def _fmt(x: float | None, nd: int = 2) -> str:
    if x is None:
        return "–"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.{nd}f}"


def _pooled(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    hbs = [e["holdback"] for e in entries if e.get("holdback")]
    if len(hbs) != len(entries) or not hbs:
        return None
    h = [v for hb in hbs for v in hb["_h"]]
    eu = [v for hb in hbs for v in hb["_eu"]]
    ex = [v for hb in hbs for v in hb["_ex"]]
    hu = [v for hb in hbs for v in hb["_hu"]]
    hx = [v for hb in hbs for v in hb["_hx"]]
    return {
        "tokens": len(h),
        "mean": statistics.fmean(h),
        "p99": _pct(h, 0.99),
        "max": max(h),
        "min_mean": statistics.fmean(hu),
        "min_max": max(hu),
        "min_exact_mean": statistics.fmean(hx),
        "min_exact_max": max(hx),
        "excess_mean": statistics.fmean(eu),
        "excess_max": max(eu),
        "excess_exact_mean": statistics.fmean(ex),
        "excess_exact_max": max(ex),
    }


def render(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown report: summary table, flatness table, targets, notes."""
    lines = ["# Aligner benchmark: tokentrail vs today's streaming detokenizers", ""]
    lines += [
        f"Run {meta['date']} on {meta['machine']['cpu']}, {meta['machine']['cores']} cores "
        f"(shared; load average {_load(meta['machine'].get('loadavg_at_start'))} at start, "
        f"{_load(meta['machine'].get('loadavg_at_end'))} at the end).",
        "",
        "Command: `" + meta["command"] + "`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        "",
        f"Streams per tokenizer: `text` = {meta['config']['text_tokens']} tokens of real "
        "prose and code (Python's reference-manual topics from `pydoc_data.topics` "
        "interleaved with multilingual paragraphs: Latin, Cyrillic, Greek, CJK, Hangul, "
        "Arabic, Hebrew, Devanagari, Thai, Vietnamese, emoji, symbols, code with tabs); "
        f"`line` = {meta['config']['line_tokens']} tokens of the same text with every "
        "newline replaced by a space. Every approach gets the same ids, encoded by the "
        "tokenizer.json the peers load, without special tokens. "
        f"Timing: median of {meta['config']['reps']} interleaved runs; a run over "
        f"{meta['config']['budget_s']:.0f} s is stopped and reported as such.",
        "",
        "*How to read a µs/token cell:* `median (steady)`. The first figure is the "
        "whole-stream time per token, median of the passes; the one in parentheses is "
        "the median over every 250-token block of every pass, which leaves out the "
        "milliseconds when another process had the CPU (this machine is shared, so "
        "those blocks are common). Compare approaches within one run.",
        "",
        "## Summary",
        "",
        "µs/tok: whole-stream cost per token, `median (steady)`. Holdback: tokens that "
        "arrived after a token before all of its bytes were emitted, pooled over both streams "
        "(mean / p99 / max); min: the least possible (only incomplete UTF-8 held); "
        "excess: approach minus min per token (mean / max). Mismatch: streams whose "
        "joined output differs from the library's own decode of the same ids (chars "
        "outside the common prefix and suffix).",
        "",
        "| Tokenizer | Approach | µs/tok text | µs/tok line | holdback mean/p99/max | "
        "min mean/max | excess mean/max | mismatches | setup ms | note |",
        "|---|---|---:|---:|---|---|---|---|---:|---|",
    ]
    for r in results:
        for name, a in r["approaches"].items():
            st = a["streams"]
            e_text, e_line = st.get("text"), st.get("line")
            pooled = _pooled([e for e in (e_text, e_line) if e])
            mism = [e for e in (e_text, e_line) if e and not e["exact"]]
            mm = (
                "0" if not mism else (f"{len(mism)}/2 ({sum(e['diff_chars'] for e in mism)} chars)")
            )
            notes = []
            for sname, e in (("text", e_text), ("line", e_line)):
                if e and e["stopped"]:
                    notes.append(f"{sname}: stopped after {e['n_done']} tokens")
            if pooled is None:
                hb = mn = ex = "n/a"
                notes += [
                    e["holdback_note"] for e in (e_text, e_line) if e and e.get("holdback_note")
                ]
            else:
                hb = f"{pooled['mean']:.3f} / {pooled['p99']} / {pooled['max']}"
                mn = f"{pooled['min_mean']:.3f} / {pooled['min_max']}"
                ex = f"{pooled['excess_mean']:+.3f} / {pooled['excess_max']:+d}"
                if (pooled["min_exact_mean"], pooled["min_exact_max"]) != (
                    pooled["min_mean"],
                    pooled["min_max"],
                ):
                    notes.append(
                        f"excess over the run-aware min: {pooled['excess_exact_mean']:+.3f} / "
                        f"{pooled['excess_exact_max']:+d}"
                    )
            lines.append(
                f"| {r['label']} | {name} | {_cost(e_text)} | {_cost(e_line)} | "
                f"{hb} | {mn} | {ex} | {mm} | "
                f"{_fmt(a['setup_ms'], 0)} | {'; '.join(notes)} |"
            )
    lines += [
        "",
        "## Cost per token as the single-line stream grows",
        "",
        "Left: µs/token over the first N tokens of the `line` stream (median of the "
        "passes). Right: the median 250-token block cost inside each window, which is "
        "what the flatness verdict uses (a preempted block cannot skew it). A flat row "
        "is O(1) per token; a growing one re-decodes or copies a growing buffer.",
        "",
        "| Tokenizer | Approach | "
        + " | ".join(f"first {cp // 1000}k" for cp in CHECKPOINTS)
        + " | "
        + " | ".join(_windows())
        + " | last / first window |",
        "|---|---|" + "---:|" * (2 * len(CHECKPOINTS) + 1),
    ]
    for r in results:
        for name, a in r["approaches"].items():
            e = a["streams"].get("line")
            if not e:
                continue
            cps = e["us_per_token_first"]
            win = e["us_per_token_window"]
            cells = [_fmt(cps.get(str(cp))) for cp in CHECKPOINTS]
            cells += [_fmt(win.get(str(cp))) for cp in CHECKPOINTS]
            ratio = _flat(e) or "–"
            if e["stopped"]:
                ratio += f" (stopped after {e['n_done']})"
            lines.append(f"| {r['label']} | {name} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "## Targets", ""]
    lines += targets(results)
    lines += [
        "",
        "## Priming with a 4k-token prompt",
        "",
        "`Aligner.fresh(prompt_ids=the first 4000 ids of the text stream)` against aligning "
        "the same 4000 ids (push each, read every segment's tokens, finish), over the same "
        "compiled tables; medians of at least 3 runs. Target: ratio at most 1.",
        "",
        "| Tokenizer | tokentrail source | prime ms | align ms | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for r in results:
        for src, p in r.get("priming", {}).items():
            lines.append(
                f"| {r['label']} | {src} | {p['prime_ms']:.2f} | {p['align_ms']:.2f} | "
                f"{p['ratio']:.2f} |"
            )
    lines += ["", "## Mismatch details", ""]
    any_mm = False
    for r in results:
        for name, a in r["approaches"].items():
            for sname, e in a["streams"].items():
                if not e["exact"]:
                    any_mm = True
                    lines.append(
                        f"- {r['label']}, {name}, `{sname}`: {e['diff_chars']} chars, "
                        f"{e['first_difference']}"
                    )
    if not any_mm:
        lines.append("- none")
    lines += ["", "## Approaches", ""]
    seen = set()
    for r in results:
        for name, a in r["approaches"].items():
            key = (r["label"], name)
            if key not in seen:
                seen.add(key)
                lines.append(f"- {r['label']} / {name}: {a['detail']}")
    lines += ["", *meta.get("notes", [])]
    return "\n".join(lines) + "\n"


def targets(results: list[dict[str, Any]]) -> list[str]:
    out = [
        "µs/token at or below DecodeStream's: `verdict median vs median (verdict steady vs "
        "steady)`. Flat: the last window's block median at most 1.25× the first's. Zero "
        "excess holdback: per token, never later than the minimum.",
        "",
        "| Tokenizer | tokentrail source | ≤ DecodeStream | "
        "flat 1k→64k | zero excess holdback | zero mismatches |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ds = r["approaches"].get("tokenizers DecodeStream")
        for name, a in r["approaches"].items():
            if not name.startswith("tokentrail"):
                continue
            cells = []
            for s in ("text", "line"):
                mine, theirs = a["streams"][s], ds["streams"][s]
                parts = []
                for key in ("us_per_token", "us_per_token_steady"):
                    m, t = mine[key], theirs[key]
                    parts.append(f"{'yes' if m <= t else 'NO'} {_fmt(m)} vs {_fmt(t)}")
                cells.append(f"{s}: {parts[0]} ({parts[1]})")
            ratio = _flat(a["streams"]["line"])
            flat = "–" if ratio is None else f"{'yes' if float(ratio) <= 1.25 else 'NO'} ({ratio}×)"
            pooled = _pooled(list(a["streams"].values()))
            if pooled is None:
                zero = "n/a"
            else:
                ok = pooled["excess_max"] <= 0
                zero = f"{'yes' if ok else 'NO'} (max {pooled['excess_max']:+d})"
                if not ok and pooled["excess_exact_max"] <= 0:
                    zero += ", 0 over the run-aware min"
            mism = sum(1 for e in a["streams"].values() if not e["exact"])
            out.append(
                f"| {r['label']} | {name} | {' / '.join(cells)} | {flat} | {zero} | "
                f"{'yes' if mism == 0 else f'NO ({mism})'} |"
            )
    return out


def strip_private(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="sanity run: 2k/4k-token streams, 1 timed rep, 3 s budget; "
        "results are printed, not written, unless --out is given",
    )
    parser.add_argument("--text-tokens", type=int, default=20000)
    parser.add_argument("--line-tokens", type=int, default=64000)
    parser.add_argument("--reps", type=int, default=3, help="timed repeats (median)")
    parser.add_argument(
        "--budget",
        type=float,
        default=20.0,
        help="seconds per approach per stream before it is stopped",
    )
    parser.add_argument(
        "--tokenizers",
        default="",
        help="comma-separated subset of: gpt2,qwen2,llama3,llama2,mistral1,t5,pegasus",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where to write align.md and align.json (default {RESULTS})",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    warnings.filterwarnings("ignore")
    if args.quick:
        args.text_tokens, args.line_tokens = 2000, 4000
        args.reps, args.budget = 1, 3.0
    for n in (args.text_tokens, args.line_tokens):
        if n <= 0 or n % BLOCK:
            parser.error(f"stream lengths must be positive multiples of {BLOCK}, got {n}")
    if not CORPUS.is_dir():
        print(f"tokenizer corpus not found at {CORPUS}; nothing to benchmark", file=sys.stderr)
        return 2
    out_dir = args.out if args.out is not None else (None if args.quick else RESULTS)
    only = {s.strip() for s in args.tokenizers.split(",") if s.strip()} or None
    cfg = Config(args.text_tokens, args.line_tokens, args.reps, args.budget, only, out_dir)
    started = time.perf_counter()
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(
            shlex.quote(a) for a in [".venv/bin/python", "benchmarks/bench_align.py", *sys.argv[1:]]
        ),
        "machine": machine(),
        "versions": versions(),
        "config": {
            "text_tokens": cfg.text_tokens,
            "line_tokens": cfg.line_tokens,
            "reps": cfg.reps,
            "budget_s": cfg.budget_s,
            "block": BLOCK,
        },
        "notes": NOTES,
    }
    docs = documents()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-align-") as tmp:
        cases = prepare_cases(Path(tmp), only)
        for case in cases:
            results.append(bench_case(case, cfg, docs))
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    meta["machine"]["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    md = render(results, meta) + f"\nWhole run: {meta['elapsed_s']} s.\n"
    print(md)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "align.md").write_text(md, encoding="utf-8")
        payload = {"meta": meta, "results": strip_private(results)}
        (out_dir / "align.json").write_text(
            json.dumps(payload, indent=1, ensure_ascii=False), encoding="utf-8"
        )
        log.info("wrote %s and %s", out_dir / "align.md", out_dir / "align.json")
    return 0


NOTES = [
    "## How to read it",
    "",
    "- Holdback is counted in tokens: 0 means a token's bytes were all out when `push` "
    "for that token returned. For tokentrail it comes from attribution (the step of the "
    "last segment that lists the token); for the others, from the step at which the "
    "emitted text first reaches the last character of the token's bytes in the "
    "reference text. Text still held at the end counts as emitted at the flush (step n+1).",
    "- The minimum is computed from the token byte pieces, checked per stream to "
    "reproduce the reference decode exactly: the earliest step after which the bytes up "
    "to the token's end are complete UTF-8. For tokenizers' ByteFallback decoder "
    "(Llama 2 / Mistral tokenizer.json) a run of byte tokens is only final when the run "
    "ends, because one invalid byte turns the whole run into U+FFFD; the run-aware "
    "minimum, and the excess over it, are given in the note column where they differ.",
    "- Peers without attribution are measured by text length; where their output is not "
    "exact, their holdback is approximate.",
    "- DecodeStream has no flush: a character cut by the end of the stream is never "
    "emitted. mlx-lm's Naive detokenizer and TextIteratorStreamer re-decode everything "
    "since the last newline, so they go quadratic on the single-line stream (and on "
    "Metaspace tokenizers whose decode never yields a newline).",
    "- The machine is a shared 2-core VM; absolute numbers move by ±20% between runs, "
    "the interleaved repeats keep the comparison within a run fair.",
]


if __name__ == "__main__":
    sys.exit(main())
