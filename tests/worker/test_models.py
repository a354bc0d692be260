"""The shipped tiny models: byte-level tokenizer, chat template, configs, package data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from worker.models import MODELS_DIR, model_dir, served_model_name
from worker.models import make_tokenizer as mk

MODEL_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]
TEXTS = ["hello world", "  two spaces\n\ttab é 漢字 🙂", "\x00\x01\x7f", ""]


@pytest.mark.parametrize("name", ["tiny", "small", "kvroute-tiny", "kvroute-small"])
def test_model_dir_has_every_file(name: str) -> None:
    folder = model_dir(name)
    assert folder.parent == MODELS_DIR
    for file_name in MODEL_FILES:
        assert (folder / file_name).is_file(), file_name
    assert served_model_name(name) == "kvroute-" + folder.name


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        model_dir("huge")


def test_committed_files_match_the_generator() -> None:
    """The committed files are exactly what make_tokenizer.py writes (no hand edits)."""
    for name in mk.MODEL_SHAPES:
        folder = model_dir(name)
        config = json.loads((folder / "config.json").read_text())
        assert config == mk.model_config(mk.MODEL_SHAPES[name][1])
        assert json.loads((folder / "tokenizer_config.json").read_text()) == mk.tokenizer_config()
        committed = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert committed.to_str() == mk.build_tokenizer().to_str()


def test_shapes() -> None:
    tiny = json.loads((model_dir("tiny") / "config.json").read_text())
    small = json.loads((model_dir("small") / "config.json").read_text())
    for config in (tiny, small):
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
        assert config["head_dim"] in (32, 64)
        assert config["vocab_size"] % 64 == 0
    assert (tiny["hidden_size"], tiny["num_hidden_layers"]) == (128, 2)
    assert (small["hidden_size"], small["num_hidden_layers"]) == (512, 4)
    assert (small["num_attention_heads"], small["num_key_value_heads"]) == (8, 4)


@pytest.mark.parametrize("text", TEXTS)
def test_every_byte_is_a_token_and_text_round_trips(text: str) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir("tiny") / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_all_bytes_round_trip() -> None:
    tokenizer = Tokenizer.from_file(str(model_dir("tiny") / "tokenizer.json"))
    every_byte = bytes(range(256)).decode("latin-1")
    assert tokenizer.decode(tokenizer.encode(every_byte).ids) == every_byte
    assert tokenizer.get_vocab_size() == mk.VOCAB_SIZE


def test_hf_tokenizer_and_chat_template() -> None:
    """What vLLM loads (transformers AutoTokenizer): no BOS on text, template with roles."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir("tiny"))
    assert tokenizer("héllo")["input_ids"] == list("héllo".encode())
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>yo<|end|>"
        "<|user|>again<|end|><|assistant|>"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt == "<s><|system|>be brief<|end|><|user|>hi<|end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|system|>")]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(list(range(256, mk.VOCAB_SIZE)), skip_special_tokens=True) == ""


def test_chat_template_rejects_unknown_role() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir("tiny"))
    with pytest.raises(Exception, match="unsupported role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_wheel_ships_model_files(tmp_path: Path) -> None:
    """A non-editable install gets the model folders (package data).

    Builds a wheel of a copy of the ``worker`` package with the real pyproject.toml, so
    the checkout gets no build/ folder and no stale build output can hide a miss.
    """
    pytest.importorskip("setuptools")
    root = MODELS_DIR.parents[1]
    source = tmp_path / "src"
    skip_cache = shutil.ignore_patterns("__pycache__")
    shutil.copytree(root / "worker", source / "worker", ignore=skip_cache)
    for file_name in ("pyproject.toml", "README.md"):
        if (root / file_name).exists():
            shutil.copy(root / file_name, source / file_name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("kvroute-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in mk.MODEL_SHAPES:
        for file_name in MODEL_FILES:
            assert f"worker/models/{name}/{file_name}" in names
