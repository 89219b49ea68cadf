"""Train tokentrail's small built-in demo model.

The demo model is a tiny Llama-architecture causal language model together with
a byte-level BPE tokenizer, both trained from scratch by this script on text the
project may redistribute:

* CPython's bundled documentation topics (``pydoc_data/topics.py`` from the
  Python standard library, PSF License Agreement);
* a multilingual section written by this script (short sentences and word
  lists in several scripts, Python string examples evaluated at build time, and
  character descriptions generated from :mod:`unicodedata`), so that the model
  sometimes emits characters whose UTF-8 bytes span several tokens;
* a few hundred tiny ChatML conversations built from the documentation topics,
  so that the chat template produces sensible answers.

The output folder uses the Hugging Face layout and loads with both
``transformers`` and ``mlx_lm``. Weights are saved as float32 so that greedy
decoding gives the same tokens in PyTorch and MLX.

Reproduce the committed model from the repository root (torch 2.13.0 on CPU, one
thread; about 15 minutes of CPU time)::

    python scripts/train_demo_model.py --output-dir src/tokentrail/demo_model

The documentation text must come from Python 3.11.7 (``pydoc_data`` differs
between Python releases); the script refuses to run on another version unless
``--allow-any-python`` is given.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import sys
import time
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
ENDOFTEXT_ID = 0
IM_END_ID = 2

EXPECTED_PYTHON = (3, 11, 7)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------
# Training text
# ---------------------------------------------------------------------------


def load_doc_topics() -> list[tuple[str, str]]:
    """Return the CPython documentation topics as sorted ``(name, text)`` pairs."""
    import pydoc_data.topics

    topics: dict[str, str] = pydoc_data.topics.topics
    return sorted((name, text.strip() + "\n") for name, text in topics.items())


# Written for this project. Columns: English, French, German, Greek, Russian,
# Chinese, Japanese, Arabic, Hindi.
LANGUAGES: list[tuple[str, str]] = [
    ("French", "Français"),
    ("German", "Deutsch"),
    ("Greek", "Ελληνικά"),
    ("Russian", "Русский"),
    ("Chinese", "中文"),
    ("Japanese", "日本語"),
    ("Arabic", "العربية"),
    ("Hindi", "हिन्दी"),
]

WORDS: list[tuple[str, ...]] = [
    ("water", "eau", "Wasser", "νερό", "вода", "水", "水", "ماء", "पानी"),
    ("fire", "feu", "Feuer", "φωτιά", "огонь", "火", "火", "نار", "आग"),
    ("sun", "soleil", "Sonne", "ήλιος", "солнце", "太阳", "太陽", "شمس", "सूरज"),
    ("moon", "lune", "Mond", "φεγγάρι", "луна", "月亮", "月", "قمر", "चाँद"),
    ("house", "maison", "Haus", "σπίτι", "дом", "房子", "家", "بيت", "घर"),
    ("book", "livre", "Buch", "βιβλίο", "книга", "书", "本", "كتاب", "किताब"),
    ("friend", "ami", "Freund", "φίλος", "друг", "朋友", "友達", "صديق", "दोस्त"),
    ("city", "ville", "Stadt", "πόλη", "город", "城市", "都市", "مدينة", "शहर"),
    ("tree", "arbre", "Baum", "δέντρο", "дерево", "树", "木", "شجرة", "पेड़"),
    ("school", "école", "Schule", "σχολείο", "школа", "学校", "学校", "مدرسة", "विद्यालय"),
    ("bread", "pain", "Brot", "ψωμί", "хлеб", "面包", "パン", "خبز", "रोटी"),
    ("coffee", "café", "Kaffee", "καφές", "кофе", "咖啡", "コーヒー", "قهوة", "कॉफ़ी"),
    ("music", "musique", "Musik", "μουσική", "музыка", "音乐", "音楽", "موسيقى", "संगीत"),
    ("language", "langue", "Sprache", "γλώσσα", "язык", "语言", "言語", "لغة", "भाषा"),
    ("number", "nombre", "Zahl", "αριθμός", "число", "数字", "数", "رقم", "संख्या"),
    ("hello", "bonjour", "hallo", "γεια σου", "привет", "你好", "こんにちは", "مرحبا", "नमस्ते"),
    ("thank you", "merci", "danke", "ευχαριστώ", "спасибо", "谢谢", "ありがとう", "شكرا", "धन्यवाद"),
    ("day", "jour", "Tag", "μέρα", "день", "天", "日", "يوم", "दिन"),
    ("night", "nuit", "Nacht", "νύχτα", "ночь", "夜晚", "夜", "ليل", "रात"),
    ("heart", "cœur", "Herz", "καρδιά", "сердце", "心", "心", "قلب", "दिल"),
    ("snake", "serpent", "Schlange", "φίδι", "змея", "蛇", "蛇", "ثعبان", "साँप"),
    ("cat", "chat", "Katze", "γάτα", "кошка", "猫", "猫", "قطة", "बिल्ली"),
    ("dog", "chien", "Hund", "σκύλος", "собака", "狗", "犬", "كلب", "कुत्ता"),
    ("street", "rue", "Straße", "δρόμος", "улица", "街道", "通り", "شارع", "सड़क"),
]

SENTENCES: dict[str, list[str]] = {
    "French": [
        "Python est un langage de programmation très populaire.",
        "Le serpent dort sous l'arbre près de la rivière.",
        "Ça marche très bien, merci beaucoup !",
        "Où est la gare, s'il vous plaît ?",
        "Les élèves écrivent des programmes à l'école.",
        "L'été dernier, nous sommes allés à la mer.",
        "Noël approche et la forêt est couverte de neige.",
    ],
    "German": [
        "Python ist eine Programmiersprache, die für ihre Lesbarkeit bekannt ist.",
        "Die Straße ist heute sehr ruhig.",
        "Ich möchte ein Stück Kuchen und einen Kaffee, bitte.",
        "Die Kinder spielen im Garten hinter dem Haus.",
        "Der Fluss fließt langsam durch die Stadt.",
        "Schöne Grüße aus München!",
        "Übung macht den Meister.",
    ],
    "Greek": [
        "Η Python είναι μια γλώσσα προγραμματισμού.",
        "Καλημέρα! Τι κάνεις σήμερα;",
        "Το σπίτι μας είναι κοντά στη θάλασσα.",
        "Ευχαριστώ πολύ για τη βοήθεια.",
        "Η γάτα κοιμάται στο παράθυρο.",
    ],
    "Russian": [
        "Python — это язык программирования.",
        "Доброе утро! Как дела?",
        "Мы живём в большом городе у реки.",
        "Спасибо за помощь.",
        "Кошка спит на окне.",
        "Сегодня хорошая погода.",
    ],
    "Chinese": [
        "Python 是一种编程语言。",
        "今天天气很好。",
        "我喜欢喝咖啡。",
        "谢谢你的帮助。",
        "我们在学校学习中文。",
        "猫在窗户上睡觉。",
    ],
    "Japanese": [
        "Python はプログラミング言語です。",
        "今日はいい天気ですね。",
        "コーヒーを一杯ください。",
        "ありがとうございます。",
        "猫が窓の上で寝ています。",
        "東京は大きな都市です。",
    ],
    "Arabic": [
        "بايثون هي لغة برمجة.",
        "صباح الخير! كيف حالك؟",
        "شكرا على المساعدة.",
        "القطة نائمة على النافذة.",
    ],
    "Hindi": [
        "पायथन एक प्रोग्रामिंग भाषा है।",
        "नमस्ते! आप कैसे हैं?",
        "मदद के लिए धन्यवाद।",
        "बिल्ली खिड़की पर सो रही है।",
    ],
}

EMOJI = [
    "🐍",
    "🎉",
    "☕",
    "🌍",
    "❤️",
    "👍",
    "🚀",
    "😀",
    "🌧️",
    "📚",
    "✨",
    "🔥",
    "🍞",
    "🐈",
    "🌙",
    "☀️",
]

# Code point ranges whose assigned characters are described line by line.
UNICODE_RANGES: list[tuple[int, int]] = [
    (0x00C0, 0x00FF),  # Latin-1 Supplement letters
    (0x0100, 0x017F),  # Latin Extended-A
    (0x0391, 0x03C9),  # Greek
    (0x0410, 0x044F),  # Cyrillic
    (0x05D0, 0x05EA),  # Hebrew
    (0x0621, 0x064A),  # Arabic
    (0x0905, 0x0939),  # Devanagari
    (0x20A0, 0x20C0),  # Currency symbols
    (0x2190, 0x21FF),  # Arrows
    (0x2200, 0x22FF),  # Mathematical operators
    (0x3041, 0x3096),  # Hiragana
    (0x30A1, 0x30FA),  # Katakana
    (0x4E00, 0x4E7F),  # CJK unified ideographs (first block)
    (0x1F300, 0x1F320),  # Miscellaneous symbols and pictographs
    (0x1F400, 0x1F43F),  # Animals
    (0x1F600, 0x1F64F),  # Emoticons
]


def utf8_hex(text: str) -> str:
    return " ".join(f"{byte:02X}" for byte in text.encode("utf-8"))


def unicode_character_lines(rng: random.Random) -> list[str]:
    """Describe characters from :data:`UNICODE_RANGES` using :mod:`unicodedata`."""
    lines: list[str] = []
    for first, last in UNICODE_RANGES:
        for code_point in range(first, last + 1):
            char = chr(code_point)
            name = unicodedata.name(char, "")
            if not name:
                continue
            style = rng.randrange(4)
            if style == 0:
                lines.append(f"U+{code_point:04X} {char} {name}")
            elif style == 1:
                lines.append(f"U+{code_point:04X} {char} {name} (UTF-8: {utf8_hex(char)})")
            elif style == 2:
                lines.append(f'"\\N{{{name}}}" == "{char}"  # U+{code_point:04X}')
            else:
                size = len(char.encode("utf-8"))
                plural = "byte" if size == 1 else "bytes"
                lines.append(
                    f"The character {char} (U+{code_point:04X}, {name}) "
                    f"takes {size} {plural} in UTF-8."
                )
    return lines


def word_lines(rng: random.Random) -> list[str]:
    """Word-list sentences in several templates."""
    lines: list[str] = []
    for row in WORDS:
        english, translations = row[0], row[1:]
        cells = ", ".join(
            f'"{word}" in {lang}' for (lang, _), word in zip(LANGUAGES, translations, strict=True)
        )
        lines.append(f'The word for "{english}" is {cells}.')
        lines.append(f"{english} | " + " | ".join(word for word in translations))
        for (lang, native), word in zip(LANGUAGES, translations, strict=True):
            template = rng.randrange(5)
            if template == 0:
                lines.append(f'In {lang}, "{english}" is written "{word}".')
            elif template == 1:
                lines.append(f"{native}: {word} ({english})")
            elif template == 2:
                lines.append(f'Translate "{english}" into {lang}: {word}')
            elif template == 3:
                lines.append(f'The {lang} word "{word}" means "{english}".')
            else:
                lines.append(f'>>> len("{word}")\n{len(word)}')
    return lines


def sentence_lines(rng: random.Random) -> list[str]:
    """Example sentences, Python string examples and emoji lines."""
    lines: list[str] = []
    natives = dict(LANGUAGES)
    for lang, sentences in SENTENCES.items():
        for sentence in sentences:
            template = rng.randrange(6)
            if template == 0:
                lines.append(f"Example sentence in {lang}: {sentence}")
            elif template == 1:
                lines.append(f"{lang} ({natives[lang]}): {sentence}")
            elif template == 2:
                lines.append(f">>> s = {sentence!r}\n>>> len(s)\n{len(sentence)}")
            elif template == 3:
                encoded = sentence.encode("utf-8")
                lines.append(f'>>> len({sentence!r}.encode("utf-8"))\n{len(encoded)}')
            elif template == 4:
                lines.append(f">>> print({sentence!r}.upper())\n{sentence.upper()}")
            else:
                lines.append(f'A {lang} speaker might say: "{sentence}"')
    for emoji in EMOJI:
        names = " + ".join(unicodedata.name(char, f"U+{ord(char):04X}") for char in emoji)
        template = rng.randrange(3)
        if template == 0:
            lines.append(f"The emoji {emoji} is {names}.")
        elif template == 1:
            lines.append(f">>> [hex(ord(c)) for c in {emoji!r}]\n{[hex(ord(c)) for c in emoji]}")
        else:
            lines.append(f"{emoji} Python {emoji} ({names}, UTF-8: {utf8_hex(emoji)})")
    return lines


def build_multilingual_documents(rng: random.Random, repeats: int) -> list[str]:
    """Build the project-written multilingual documents.

    The word and sentence sections are regenerated ``repeats`` times with fresh
    template choices and order; the :mod:`unicodedata` section appears once.
    """
    documents: list[str] = []
    for _ in range(repeats):
        lines = word_lines(rng) + sentence_lines(rng)
        rng.shuffle(lines)
        for start in range(0, len(lines), 12):
            documents.append("\n".join(lines[start : start + 12]) + "\n")
    char_lines = unicode_character_lines(rng)
    for start in range(0, len(char_lines), 40):
        documents.append("\n".join(char_lines[start : start + 40]) + "\n")
    return documents


HEADING = re.compile(r"^(?P<title>[^\n]+)\n(?P<rule>[*=\-~^]+)\n", re.MULTILINE)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"*(])")


@dataclass(frozen=True)
class Section:
    title: str
    body: str


def doc_sections(topics: Sequence[tuple[str, str]]) -> list[Section]:
    """Split the documentation topics at their underlined headings."""
    sections: list[Section] = []
    for _, text in topics:
        matches = [
            m for m in HEADING.finditer(text) if len(m.group("rule")) == len(m.group("title"))
        ]
        for index, match in enumerate(matches):
            end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
            sections.append(Section(match.group("title").strip(), text[match.end() : end]))
    return sections


def first_sentences(body: str, max_chars: int = 320) -> str | None:
    """Return the opening sentences of the first prose paragraph of ``body``."""
    for paragraph in body.split("\n\n"):
        if not paragraph.strip() or paragraph.startswith((" ", "\t")):
            continue
        prose = " ".join(line.strip() for line in paragraph.splitlines())
        if not prose[0].isupper() or len(prose) < 40:
            continue
        answer = ""
        for sentence in SENTENCE_END.split(prose):
            if answer and len(answer) + len(sentence) + 1 > max_chars:
                break
            answer = f"{answer} {sentence}".strip()
        if answer.endswith((".", ":")):
            return answer.rstrip(":") + ("." if answer.endswith(":") else "")
    return None


QUESTION_TEMPLATES = [
    "What is {x}?",
    "Tell me about {x}.",
    "Explain {x}.",
    "Can you describe {x}?",
    "What does the documentation say about {x}?",
]


def chat(user: str, assistant: str) -> str:
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"


def build_conversations(topics: Sequence[tuple[str, str]], rng: random.Random) -> list[str]:
    """Tiny ChatML conversations about documentation sections and words."""
    conversations: list[str] = []
    for section in doc_sections(topics):
        answer = first_sentences(section.body)
        if answer is None:
            continue
        subject = section.title
        if subject.startswith("The "):
            subject = "the " + subject[4:]
        for template in rng.sample(QUESTION_TEMPLATES, 2):
            conversations.append(chat(template.format(x=subject), answer))
    for row in WORDS:
        english, translations = row[0], row[1:]
        for (lang, _), word in rng.sample(list(zip(LANGUAGES, translations, strict=True)), 3):
            conversations.append(
                chat(
                    f'How do you say "{english}" in {lang}?', f'In {lang}, "{english}" is "{word}".'
                )
            )
    for lang, sentences in SENTENCES.items():
        for sentence in rng.sample(sentences, 2):
            conversations.append(chat(f"Give me an example sentence in {lang}.", sentence))
    return conversations


def build_documents(seed: int, multilingual_repeats: int) -> tuple[list[str], dict[str, int]]:
    """Return the shuffled training documents and their character counts by source."""
    rng = random.Random(seed)
    topics = load_doc_topics()
    docs = [text for _, text in topics]
    multilingual = build_multilingual_documents(rng, multilingual_repeats)
    conversations = build_conversations(topics, rng)
    stats = {
        "documentation_chars": sum(map(len, docs)),
        "multilingual_chars": sum(map(len, multilingual)),
        "conversation_chars": sum(map(len, conversations)),
        "conversations": len(conversations),
    }
    documents = docs + multilingual + conversations
    rng.shuffle(documents)
    return documents, stats


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def train_tokenizer(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose special tokens take ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == index, token
    return tokenizer


def encode_stream(tokenizer: Tokenizer, documents: Sequence[str]) -> torch.Tensor:
    """Encode documents into one stream, each document followed by ``<|endoftext|>``."""
    ids: list[int] = [ENDOFTEXT_ID]
    for encoding in tokenizer.encode_batch(list(documents), add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(ENDOFTEXT_ID)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------
# Model training
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    train_segments: list[torch.Tensor]
    val_blocks: torch.Tensor


def split_stream(stream: torch.Tensor, context: int, val_every: int) -> Split:
    """Hold out every ``val_every``-th block of ``context`` tokens for validation.

    The blocks in between form contiguous training segments from which windows
    are drawn at random offsets.
    """
    n_blocks = len(stream) // context
    blocks = stream[: n_blocks * context].view(n_blocks, context)
    val_index = list(range(val_every - 1, n_blocks, val_every))
    segments: list[torch.Tensor] = []
    start = 0
    for index in [*val_index, n_blocks]:
        if index > start:
            segments.append(blocks[start:index].reshape(-1))
        start = index + 1
    return Split(train_segments=segments, val_blocks=blocks[val_index])


def sample_batch(
    split: Split, batch_size: int, context: int, generator: torch.Generator
) -> torch.Tensor:
    sizes = torch.tensor(
        [len(segment) - context + 1 for segment in split.train_segments], dtype=torch.float
    )
    choices = torch.multinomial(sizes, batch_size, replacement=True, generator=generator)
    rows = []
    for choice in choices.tolist():
        segment = split.train_segments[choice]
        start = int(torch.randint(0, len(segment) - context + 1, (1,), generator=generator))
        rows.append(segment[start : start + context])
    return torch.stack(rows)


def fixed_train_blocks(split: Split, context: int, count: int) -> torch.Tensor:
    """Deterministic training blocks for reporting the training loss."""
    blocks = [
        segment[: len(segment) // context * context].view(-1, context)
        for segment in split.train_segments
    ]
    every = torch.cat(blocks)
    step = max(1, len(every) // count)
    return every[::step][:count]


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size]
        loss = model(input_ids=batch, labels=batch).loss
        total += float(loss) * len(batch)
        count += len(batch)
    model.train()
    return total / count


def learning_rate(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_model(args: argparse.Namespace, vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[ENDOFTEXT_ID, IM_END_ID],
        pad_token_id=ENDOFTEXT_ID,
        attention_bias=False,
        mlp_bias=False,
    )
    return LlamaForCausalLM(config)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, object]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train(model: LlamaForCausalLM, split: Split, args: argparse.Namespace) -> Iterator[str]:
    """Run the training loop, yielding progress lines."""
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(
        parameter_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8
    )
    model.train()
    started = time.monotonic()
    for step in range(args.steps):
        lr = learning_rate(step, args.steps, args.lr, args.warmup, args.lr * args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(split, args.batch_size, args.context, generator)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.monotonic() - started
            line = f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}  {elapsed:7.1f}s"
            if step % args.eval_every == 0 and step > 0:
                line += f"  val {mean_loss(model, split.val_blocks, args.batch_size):.4f}"
            yield line


# ---------------------------------------------------------------------------
# Output folder
# ---------------------------------------------------------------------------


def write_tokenizer_files(tokenizer: Tokenizer, output_dir: Path) -> None:
    tokenizer.save(str(output_dir / "tokenizer.json"))
    added = {
        str(index): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for index, token in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END],
    }
    for name, payload in [
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
    ]:
        (output_dir / name).write_text(
            json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def save_model(model: LlamaForCausalLM, output_dir: Path) -> None:
    model = model.to(torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[ENDOFTEXT_ID, IM_END_ID],
        pad_token_id=ENDOFTEXT_ID,
    )
    model.save_pretrained(output_dir, safe_serialization=True)
    # transformers 5 writes RoPE settings as ``rope_parameters``; also record the
    # classic ``rope_theta`` key read by other loaders (mlx_lm, transformers 4).
    config_path = output_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def copy_python_license(output_dir: Path) -> None:
    license_path = (
        Path(sys.base_prefix)
        / "lib"
        / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        / "LICENSE.txt"
    )
    if license_path.exists():
        shutil.copyfile(license_path, output_dir / "LICENSE-PSF.txt")
    else:
        print(f"warning: {license_path} not found; LICENSE-PSF.txt not written", file=sys.stderr)


@torch.no_grad()
def greedy_sample(
    model: LlamaForCausalLM, tokenizer: Tokenizer, prompt: str, new_tokens: int
) -> str:
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
    output = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0].tolist(), skip_special_tokens=False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("src/tokentrail/demo_model"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=3072)
    parser.add_argument("--hidden-size", type=int, default=192)
    parser.add_argument("--intermediate-size", type=int, default=448)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--multilingual-repeats", type=int, default=4)
    parser.add_argument(
        "--val-every", type=int, default=20, help="hold out every N-th block for validation"
    )
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allow-any-python", action="store_true")
    parser.add_argument(
        "--data-only", action="store_true", help="build text and tokenizer, report sizes, stop"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if sys.version_info[:3] != EXPECTED_PYTHON and not args.allow_any_python:
        raise SystemExit(
            f"pydoc_data must come from Python {'.'.join(map(str, EXPECTED_PYTHON))}; "
            "pass --allow-any-python to train anyway"
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    started = time.monotonic()

    documents, stats = build_documents(args.seed, args.multilingual_repeats)
    tokenizer = train_tokenizer(documents, args.vocab_size)
    stream = encode_stream(tokenizer, documents)
    split = split_stream(stream, args.context, args.val_every)
    total_chars = sum(map(len, documents))
    print(json.dumps(stats))
    print(
        f"{len(documents)} documents, {total_chars} characters, {len(stream)} tokens "
        f"({total_chars / len(stream):.2f} chars/token), {len(split.val_blocks)} validation blocks"
    )
    if args.data_only:
        return

    model = build_model(args, tokenizer.get_vocab_size())
    print(f"{sum(p.numel() for p in model.parameters())} parameters")
    for line in train(model, split, args):
        print(line, flush=True)
    train_seconds = time.monotonic() - started

    train_loss = mean_loss(
        model, fixed_train_blocks(split, args.context, len(split.val_blocks)), args.batch_size
    )
    val_loss = mean_loss(model, split.val_blocks, args.batch_size)
    print(
        f"final train loss {train_loss:.4f}  validation loss {val_loss:.4f}  ({train_seconds:.0f}s)"
    )

    args.output_dir.mkdir(parents=True, exist_ok=True)
    save_model(model, args.output_dir)
    write_tokenizer_files(tokenizer, args.output_dir)
    copy_python_license(args.output_dir)
    (args.output_dir / "training_summary.json").write_text(
        json.dumps(
            {
                "command": "python " + " ".join(sys.argv),
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "seconds": round(train_seconds),
                "train_loss": round(train_loss, 4),
                "validation_loss": round(val_loss, 4),
                "tokens": len(stream),
                **stats,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    for prompt in [
        "The for statement",
        'The word for "water" is',
        f'{IM_START}user\nWhat is the "if" statement?{IM_END}\n{IM_START}assistant\n',
    ]:
        print(repr(greedy_sample(model, tokenizer, prompt, 60)))


if __name__ == "__main__":
    main()
