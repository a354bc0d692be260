"""Tiny offline models shipped as package data (config + tokenizer, no weights).

- ``tiny``  (served as ``kvroute-tiny``): LlamaForCausalLM, hidden 128, 2 layers,
  4 heads, 2 KV heads, head_dim 32; fast tests.
- ``small`` (served as ``kvroute-small``): hidden 512, 4 layers, 8 heads, 4 KV heads,
  head_dim 64; CPU prefill slow enough that cache hits show in TTFT.

Both share one byte-level tokenizer (token id == byte value, specials from 256, no BOS
added to completion prompts) and a chat template; ``make_tokenizer.py`` writes them all.
vLLM serves them with ``--load-format dummy`` (random weights).
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent

# folder name -> the name vLLM serves it under (--served-model-name)
SERVED_MODEL_NAMES: dict[str, str] = {"tiny": "kvroute-tiny", "small": "kvroute-small"}


def model_dir(name: str) -> Path:
    """The folder of the shipped model ``name`` (``tiny`` or ``small``; the served names
    ``kvroute-tiny`` / ``kvroute-small`` are accepted too)."""
    folder = name.removeprefix("kvroute-")
    if folder not in SERVED_MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; known: {sorted(SERVED_MODEL_NAMES)}")
    return MODELS_DIR / folder


def served_model_name(name: str) -> str:
    """The served model name for a shipped model folder name (``tiny`` -> ``kvroute-tiny``)."""
    return SERVED_MODEL_NAMES[model_dir(name).name]
