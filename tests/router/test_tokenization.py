"""``ModelTokenizer`` unit tests: token ids equal transformers' (what vLLM calls) for the
shipped tiny model and for synthetic configs that exercise BOS handling, "openai"
content format, tools, ``continue_final_message`` and the developer role; vLLM's
message-parsing rules; clear errors for what cannot be routed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvindex.hashing import hash_prompt
from router.tokenization import ModelTokenizer, TokenizationError
from worker.models import model_dir

TINY = model_dir("tiny")

# A template that loops over content parts ("openai" format), uses tools, tojson,
# the developer role and a {% generation %} block, like many production templates.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'developer' %}dev:{% endif %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}"
    "{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "é!"}]},
    {"role": "assistant", "content": "Hello <|user|> there"},
    {"role": "user", "content": "  spaces  \n"},
]


def make_model(tmp_path: Path, **config_changes: Any) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(TINY / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_tokenizer(folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


BOS_POST_PROCESSOR = {
    "type": "TemplateProcessing",
    "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
    ],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [256], "tokens": ["<s>"]}},
}  # fmt: skip


@pytest.mark.parametrize("add_bos_flag", [None, False, True])
@pytest.mark.parametrize("bos_in_file", [False, True])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_completion_ids_equal_transformers(
    tmp_path: Path, add_bos_flag: bool | None, bos_in_file: bool, add_special_tokens: bool
) -> None:
    """BOS comes from tokenizer.json's post-processor; the config flag changes nothing."""
    folder = make_model(tmp_path, add_bos_token=add_bos_flag, add_eos_token=None)
    if bos_in_file:
        data = json.loads((folder / "tokenizer.json").read_text())
        data["post_processor"] = BOS_POST_PROCESSOR
        (folder / "tokenizer.json").write_text(json.dumps(data))
    ours = ModelTokenizer.from_dir(folder)
    theirs = hf_tokenizer(folder)
    long_text = "a <s> b <|user|>\n üñí©ødé 🙂 " * 400  # past the GIL-free batch path's floor
    for text in ["hello", "", "a <s> b <|user|>\n", "üñí©ødé 🙂", "x" * 300, long_text]:
        expected = theirs(text, add_special_tokens=add_special_tokens)["input_ids"]
        got = ours.completion_token_ids(text, add_special_tokens=add_special_tokens)
        assert got == expected
        assert (got[:1] == [256]) == (bos_in_file and add_special_tokens)
    assert ours.completion_token_ids([5, 6, 7]) == [5, 6, 7]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_ids_equal_transformers_for_the_tiny_model(add_generation_prompt: bool) -> None:
    ours = ModelTokenizer.from_dir(TINY)
    theirs = hf_tokenizer(TINY)
    # vLLM hands transformers string content for this "string"-format template.
    flat = [{**m, "content": "\n".join(p["text"] for p in m["content"])}
            if isinstance(m["content"], list) else m for m in MESSAGES]  # fmt: skip
    expected = theirs.apply_chat_template(
        flat, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    got = ours.chat_token_ids(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got[0] == 256  # the template's BOS, and no second one from encoding


def test_openai_format_tools_developer_and_continue_final_message(tmp_path: Path) -> None:
    folder = make_model(tmp_path, chat_template=PARTS_TEMPLATE, add_bos_token=True)
    ours = ModelTokenizer.from_dir(folder)
    theirs = hf_tokenizer(folder)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "ü"}}}]
    as_parts = [
        {**m, "content": m["content"] if isinstance(m["content"], list)
         else [{"type": "text", "text": m["content"]}]}
        for m in MESSAGES
    ]  # fmt: skip
    expected = theirs.apply_chat_template(
        as_parts, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ours.chat_token_ids(MESSAGES, tools=tools) == expected
    # The template names "developer": the role is kept.
    dev = [{"role": "developer", "content": "be nice"}, *MESSAGES[1:2]]
    assert "<|developer|>dev:be nice" in ours.render_chat(dev)
    # Continue an assistant message: cut right after its text, no end marker.
    partial = [*MESSAGES[:2], {"role": "assistant", "content": "Once upon"}]
    rendered = ours.render_chat(partial, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("<|assistant|>Once upon")
    expected_ids = theirs.apply_chat_template(
        [*as_parts[:2], {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}]}],
        tokenize=True, add_generation_prompt=False, continue_final_message=True, return_dict=False,
    )  # fmt: skip
    got = ours.chat_token_ids(partial, add_generation_prompt=False, continue_final_message=True)
    assert got == expected_ids


def test_vllm_message_rules() -> None:
    ours = ModelTokenizer.from_dir(TINY)
    rendered = ours.render_chat(
        [
            {"role": "system", "content": "x-anthropic-billing-header: cch=1\nkeep me"},
            {"role": "user", "content": None},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            {"role": "developer", "content": "dev note"},
        ]
    )
    # billing header stripped, None content empty, developer merged into one system message
    assert (
        rendered == "<s><|system|>keep me\n\ndev note<|end|><|user|><|end|>"
        "<|assistant|>ok<|end|><|assistant|>"
    )


def test_errors_are_clear() -> None:
    ours = ModelTokenizer.from_dir(TINY)
    cases: list[tuple[Any, dict[str, Any], str]] = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], {}, "image_url"),
        ([], {}, "empty"),
        ("hello", {}, "list"),
        ([{"content": "no role"}], {}, "role"),
        ([{"role": "user", "content": 5}], {}, "string or a list"),
        ([{"role": "tool", "content": "x"}], {}, "unsupported role"),
        ([{"role": "user", "content": "x"}], {"continue_final_message": True}, "not compatible"),
    ]  # fmt: skip
    for messages, kwargs, match in cases:
        with pytest.raises(TokenizationError, match=match) as info:
            ours.chat_token_ids(messages, **kwargs)
        assert info.value.param in {"messages", "continue_final_message"}
    with pytest.raises(TokenizationError, match="non-negative"):
        ours.completion_token_ids([1, -2])


def test_fingerprints_and_namespace(tmp_path: Path) -> None:
    tiny = ModelTokenizer.from_dir(TINY)
    other = ModelTokenizer.from_dir(make_model(tmp_path, chat_template=PARTS_TEMPLATE))
    assert tiny.fingerprint == other.fingerprint  # same tokenizer.json
    assert tiny.chat_template_fingerprint != other.chat_template_fingerprint
    ids = tiny.chat_token_ids(MESSAGES)
    ns_a, ns_b = tiny.namespace("m", 32), other.namespace("m", 32)
    assert hash_prompt(ns_a, ids) != hash_prompt(ns_b, ids)  # a template change never hits


def test_missing_chat_template_and_folder(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    shutil.copy(TINY / "tokenizer.json", folder / "tokenizer.json")
    plain = ModelTokenizer.from_dir(folder)
    assert not plain.has_chat_template
    assert plain.completion_token_ids("ab") == [97, 98]
    with pytest.raises(TokenizationError, match="no chat template"):
        plain.chat_token_ids(MESSAGES)
    with pytest.raises(FileNotFoundError):
        ModelTokenizer.from_dir(tmp_path / "missing")


def test_chat_request_merges_fields_like_vllm(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
        "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}|{% endif %}"
        "{% if enable_thinking is defined %}think={{ enable_thinking }}|{% endif %}"
        "{% if flavour is defined %}flavour={{ flavour }}|{% endif %}"
        "{% if add_generation_prompt %}GEN{% endif %}"
    )
    ours = ModelTokenizer.from_dir(make_model(tmp_path, chat_template=template))
    messages = [{"role": "user", "content": "hi"}]

    def text(body: dict[str, Any]) -> str:
        return bytes(ours.chat_request_token_ids({"messages": messages, **body})).decode()

    assert text({}) == "hi|GEN"  # add_generation_prompt defaults to True; no effort passed
    # The request's own field beats chat_template_kwargs; other kwargs reach the template.
    kwargs = {"add_generation_prompt": True, "flavour": "x"}
    assert text({"add_generation_prompt": False, "chat_template_kwargs": kwargs}) == "hi|flavour=x|"
    assert text({"reasoning_effort": "low"}) == "hi|effort=low|think=True|GEN"
    assert text({"reasoning_effort": "none"}) == "hi|effort=none|think=False|GEN"
    override = {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert text(override) == "hi|effort=high|think=False|GEN"
    for body, param in [
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"tools": {}}, "tools"),
    ]:
        with pytest.raises(TokenizationError) as info:
            text(body)
        assert info.value.param == param
    with pytest.raises(TokenizationError, match="messages"):
        ours.chat_request_token_ids({"messages": "hi"})
