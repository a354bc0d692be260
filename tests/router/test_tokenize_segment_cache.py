"""The prompt segment cache (``router.token_segments``): the ids are always those of
encoding the whole text, for the shipped tokenizer and for tokenizers built here like
production ones (byte-level BPE with ChatML markers, with a BOS post-processor, a
sentencepiece-style Metaspace BPE, a BERT-style WordPiece); the self-check refuses a
tokenizer where segmenting changes ids; the LRU stays within its token bound; tenants
(and cache salts) never share an entry; concurrent threads agree."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from router.app import start_server
from router.config import RouterConfig
from router.engines import ENGINES
from router.metrics import RouterMetrics
from router.prompt_tokenizers import EnginePromptTokenizer, LocalPromptTokenizer, TokenizePool
from router.token_segments import (
    CHUNK_CHARS,
    ENTRY_OVERHEAD_TOKENS,
    CacheScope,
    SegmentCache,
    SegmentedEncoder,
    _literal_matcher,
    line_cuts,
)
from router.tokenization import ModelTokenizer
from router.tokenizer_registry import TokenizerRegistry
from tests.router.fakes import run
from worker.models import model_dir

ANONYMOUS = CacheScope(None, None)
WORDS = ["hello", "world", "the", "cache", "Ünïcödé", "中文", "😀", "é", "code=1;", "x"]
SPACES = [" ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "Hello world, hello router: the prefix cache keeps blocks of tokens.\n\n",
    "  indented\tcode = cache.get(key)  # comment\n",
    "Ünïcödé text, 中文 字符, emoji 😀 and accents é à ü.\n",
    "Question: which worker holds the document? Answer: the one with the longest prefix.\n",
] * 20
# A chat template whose turn markers are each tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ open }}{{ m['role'] }}\n{{ m['content'] }}{{ close }}\n"
    "{% endfor %}{% if add_generation_prompt %}{{ open }}assistant\n{% endif %}"
)
MARKERS = {
    "chatml_byte_level": ("<|im_start|>", "<|im_end|>"),
    "llama3_regex": ("<|im_start|>", "<|im_end|>"),
    "llama3_like_bos": ("<|im_start|>", "<|im_end|>"),
    "metaspace_always": ("[INST]", "[/INST]"),
    "bert_like": ("[SEP]", "[SEP]"),
}


# --- tokenizers like production ones, trained in memory --------------------------------


def chatml_byte_level(bos: bool = False) -> Tokenizer:
    """GPT-2/Qwen style (Llama 3 style with ``bos``): byte-level BPE, GPT-2 regex, ChatML
    special tokens, a non-special added token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    if bos:
        bos_id = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)]
        )
    return tokenizer


# Llama 3's pre-tokenizer regex (its tokenizer.json); GPT-4o's treats newlines alike.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def llama3_regex() -> Tokenizer:
    """Llama 3 style: its split regex (a newline run is one pre-token), then byte-level
    BPE without GPT-2's regex; ChatML special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def metaspace(prepend_scheme: str = "always") -> Tokenizer:
    """Llama 2 / Mistral style: Metaspace BPE, ``<s>`` added by the post-processor."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tokenizer.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def bert_like() -> Tokenizer:
    """WordPiece, lower-casing normalizer, ``[CLS] $A [SEP]``, an ``lstrip`` ``[MASK]``
    (matched, never cut at)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]"]
    trainer = trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=specials, show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens([AddedToken("[MASK]", special=True, lstrip=True)])
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return tokenizer


def tiny() -> Tokenizer:
    return Tokenizer.from_file(str(model_dir("tiny") / "tokenizer.json"))


BUILDERS: dict[str, Callable[[], Tokenizer]] = {
    "tiny": tiny,
    "chatml_byte_level": chatml_byte_level,
    "llama3_like_bos": lambda: chatml_byte_level(bos=True),
    "llama3_regex": llama3_regex,
    "metaspace_always": metaspace,
    "bert_like": bert_like,
}
TOKENIZERS = {name: build() for name, build in BUILDERS.items()}


def added_contents(tokenizer: Tokenizer) -> list[str]:
    return sorted(t.content for t in tokenizer.get_added_tokens_decoder().values())


def model_tokenizer(
    tokenizer: Tokenizer, cache: SegmentCache | None, markers: tuple[str, str] = ("", "")
) -> ModelTokenizer:
    return ModelTokenizer(
        tokenizer,
        tokenizer_json=tokenizer.to_str().encode(),
        special_tokens={"open": markers[0], "close": markers[1]},  # template variables
        chat_template=CHAT_TEMPLATE,
        segment_cache=cache,
    )


def no_session() -> aiohttp.ClientSession:
    raise AssertionError("no engine backend here")


def long_text(seed: int, num_chars: int = 6000) -> str:
    """Words and whitespace of every kind, at least ``num_chars`` characters."""
    rng = random.Random(seed)
    parts: list[str] = []
    while sum(map(len, parts)) < num_chars:
        parts.append(rng.choice(WORDS))
        parts.append(rng.choice(SPACES))
    return "".join(parts)


def num_chunks(tokenizer: Tokenizer, segment: str) -> int:
    """Cache entries a long segment takes: its line-cut chunks (1 without line cuts)."""
    encoder = SegmentedEncoder.build(tokenizer, SegmentCache(1))
    assert encoder is not None
    rule = encoder.line_cut_rule
    return 1 if rule is None else len(line_cuts(segment, 0, len(segment), CHUNK_CHARS, rule)) + 1


def whole(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


# --- the ids equal encoding the whole text ------------------------------------------------


def test_shipped_tokenizer_chat_and_completion_ids_equal_uncached() -> None:
    """The shipped tiny tokenizer and chat template: a long document in the system message,
    new questions each time; long completion prompts, repeated; both ways of BOS."""
    cache = SegmentCache(1_000_000)
    cached = ModelTokenizer.from_dir(model_dir("tiny"), segment_cache=cache)
    plain = ModelTokenizer.from_dir(model_dir("tiny"))
    assert cached.segment_caching and not plain.segment_caching
    document = long_text(1, 20_000)
    doc_misses = 0
    for question in ["What is cached?", "  and now?\n", "<|user|> sneaky", ""]:
        messages = [
            {"role": "system", "content": document},
            {"role": "user", "content": question},
        ]
        for add_special_tokens in (False, True):
            want = plain.chat_token_ids(messages, add_special_tokens=add_special_tokens)
            got = cached.chat_token_ids(
                messages, add_special_tokens=add_special_tokens, cache_scope=ANONYMOUS
            )
            assert got == want
            doc_misses = doc_misses or cache.stats().misses
    # the document's chunks once (line cuts: a 20K-character text is several)
    assert cache.stats().misses == doc_misses >= num_chunks(tiny(), document) - 1 > 1
    assert cache.stats().hits == (4 * 2 - 1) * doc_misses
    prompt = long_text(2, 9000)
    for _ in range(2):
        for add_special_tokens in (False, True):
            want = plain.completion_token_ids(prompt, add_special_tokens=add_special_tokens)
            got = cached.completion_token_ids(
                prompt, add_special_tokens=add_special_tokens, cache_scope=ANONYMOUS
            )
            assert got == want
    stats = cache.stats()
    prompt_misses = stats.misses - doc_misses  # the completion prompt's chunks, once
    assert prompt_misses == num_chunks(tiny(), prompt) > 1
    assert stats.hits == (4 * 2 - 1) * doc_misses + (2 * 2 - 1) * prompt_misses


@pytest.mark.parametrize("name", list(MARKERS))
def test_production_like_tokenizers_chat_and_completion_ids_equal_uncached(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    cache = SegmentCache(1_000_000)
    cached = model_tokenizer(tokenizer, cache, MARKERS[name])
    plain = model_tokenizer(tokenizer, None, MARKERS[name])
    assert cached.segment_caching, name
    document = long_text(3, 12_000)
    specials = added_contents(tokenizer)
    doc_misses = 0
    for question in ["Which worker?", f" {specials[0]} mixed\n", "\n\n"]:
        messages = [
            {"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": document},
            {"role": "user", "content": question},
        ]
        for add_special_tokens in (False, True):
            want = plain.chat_token_ids(messages, add_special_tokens=add_special_tokens)
            for _ in range(2):  # a miss, then a hit
                assert want == cached.chat_token_ids(
                    messages, add_special_tokens=add_special_tokens, cache_scope=ANONYMOUS
                )
                doc_misses = doc_misses or cache.stats().misses
    assert cache.stats().misses == doc_misses >= num_chunks(tokenizer, document) - 1  # once
    joined = f"{specials[-1]}\n".join([long_text(4), " ", long_text(5), ""])
    for add_special_tokens in (False, True):
        want = plain.completion_token_ids(joined, add_special_tokens=add_special_tokens)
        for _ in range(2):
            assert want == cached.completion_token_ids(
                joined, add_special_tokens=add_special_tokens, cache_scope=ANONYMOUS
            )
    # and the two long parts of the completion prompt
    parts = num_chunks(tokenizer, long_text(4)) + num_chunks(tokenizer, "\n" + long_text(5))
    assert cache.stats().misses == doc_misses + parts


def _texts(tokenizer: Tokenizer) -> st.SearchStrategy[str]:
    pieces = WORDS + SPACES + added_contents(tokenizer) + ["<", "|", "<|im", "[", "]"]
    return st.lists(st.sampled_from(pieces), max_size=40).map("".join)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_segmented_equals_whole_for_random_texts(name: str) -> None:
    """Every cut made (``segmented_ids``: at every cut token and line cut), and the cached
    path with 4-character segments and chunks (a miss, then a hit), equal encoding the
    whole text."""
    tokenizer = TOKENIZERS[name]
    cache = SegmentCache(100_000, min_segment_chars=4, chunk_chars=4)
    encoder = SegmentedEncoder.build(tokenizer, cache)
    assert encoder is not None

    @settings(max_examples=150, deadline=None)
    @given(text=_texts(tokenizer), add_special_tokens=st.booleans())
    def check(text: str, add_special_tokens: bool) -> None:
        want = whole(tokenizer, text, add_special_tokens)
        assert encoder.segmented_ids(text, add_special_tokens=add_special_tokens) == want
        for _ in range(2):
            got = encoder.encode(text, add_special_tokens=add_special_tokens, scope=ANONYMOUS)
            assert got == want

    check()


# --- line cuts: a long text cut at line starts ---------------------------------------------


def test_line_cut_rule_follows_the_pre_tokenizer() -> None:
    """Llama 3's regex keeps a newline run one pre-token, so any line start is a cut;
    GPT-2's gives a whitespace run at the text's end one more pre-token, so only a lone
    newline is; Metaspace (each chunk gets its own "▁") and a tokenizer with a
    whitespace-stripping added token get none."""
    rules = {}
    for name, tokenizer in TOKENIZERS.items():
        encoder = SegmentedEncoder.build(tokenizer, SegmentCache(10))
        assert encoder is not None
        rules[name] = encoder.line_cut_rule
    assert rules == {
        "tiny": "after_newlines",
        "chatml_byte_level": "lone_newline",
        "llama3_like_bos": "lone_newline",
        "llama3_regex": "after_newlines",
        "metaspace_always": None,
        "bert_like": None,  # its [MASK] strips the whitespace on its left
    }
    gpt2 = TOKENIZERS["chatml_byte_level"]
    blind_cut = whole(gpt2, "end.\n\n", False) + whole(gpt2, "Next", False)
    assert blind_cut != whole(gpt2, "end.\n\nNext", False)  # what the self-check caught
    assert line_cuts("end.\n\nNext\nline", 0, 15, 1, "lone_newline") == [11]
    assert line_cuts("end.\n\nNext\nline", 0, 15, 1, "after_newlines") == [6, 11]


@pytest.mark.parametrize("name", ["tiny", "chatml_byte_level", "llama3_regex"])
def test_a_document_and_its_question_in_one_text_miss_only_the_last_chunk(name: str) -> None:
    """Questions appended to one long document (RAG prompts, one text): after the first,
    each question misses only the chunk it ends; the ids equal encoding the whole."""
    tokenizer = TOKENIZERS[name]
    cache = SegmentCache(1_000_000)
    encoder = SegmentedEncoder.build(tokenizer, cache)
    assert encoder is not None and encoder.line_cut_rule is not None
    document = long_text(11, 40_000)
    for number, question in enumerate(["Which worker?", "And the cache?\n", " 中文 😀"]):
        text = f"{document}\n\nQuestion: {question}"
        before = cache.stats()
        for add_special_tokens in (False, True):
            want = whole(tokenizer, text, add_special_tokens)
            got = encoder.encode(text, add_special_tokens=add_special_tokens, scope=ANONYMOUS)
            assert got == want
        after = cache.stats()
        chunks = num_chunks(tokenizer, text)
        assert chunks >= 40_000 // CHUNK_CHARS
        if number == 0:
            assert (after.misses - before.misses, after.hits - before.hits) == (
                chunks,
                chunks,
            )
        else:  # the first encode misses the last chunk only; the second finds it too
            assert (after.misses - before.misses, after.hits - before.hits) == (
                1,
                2 * chunks - 1,
            )


def test_shipped_chat_template_with_the_document_and_question_in_one_message() -> None:
    cache = SegmentCache(1_000_000)
    cached = ModelTokenizer.from_dir(model_dir("tiny"), segment_cache=cache)
    plain = ModelTokenizer.from_dir(model_dir("tiny"))
    document = long_text(12, 30_000)
    misses = []
    for question in ["Which worker holds it?", "What is a block?"]:
        messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
        before = cache.stats().misses
        got = cached.chat_token_ids(messages, add_special_tokens=True, cache_scope=ANONYMOUS)
        assert got == plain.chat_token_ids(messages, add_special_tokens=True)
        misses.append(cache.stats().misses - before)
    assert misses[0] > 5 and misses[1] == 1


def test_an_added_token_containing_a_special_one_is_never_cut_inside() -> None:
    """Added tokens are matched leftmost-longest, as tokenizers does: ``<|a|>tail`` (not
    special) wins over the special ``<|a|>`` it starts with."""
    tokenizer = chatml_byte_level()
    tokenizer.add_special_tokens(["<|a|>"])
    tokenizer.add_tokens([AddedToken("<|a|>tail", normalized=False)])
    encoder = SegmentedEncoder.build(tokenizer, SegmentCache(10_000, min_segment_chars=2))
    assert encoder is not None and "<|a|>" in encoder.cut_tokens
    for text in ["x <|a|>tail y", "<|a|>tai", "<|a|><|a|>tail<|a|>", "head <|a|>tail<|a|> z"]:
        want = whole(tokenizer, text, False)
        assert encoder.segmented_ids(text, add_special_tokens=False) == want
        assert encoder.encode(text, add_special_tokens=False, scope=ANONYMOUS) == want


@settings(max_examples=200, deadline=None)
@given(
    literals=st.lists(st.text("<|ab>", min_size=1, max_size=5), min_size=1, max_size=8),
    text=st.text("<|ab> x", max_size=30),
)
def test_trie_matcher_is_leftmost_longest(literals: list[str], text: str) -> None:
    matcher = _literal_matcher(literals)
    assert matcher is not None
    ordered = sorted(set(literals), key=len, reverse=True)  # alternation: longest first
    reference = re.compile("|".join(map(re.escape, ordered)))
    assert [m.span() for m in matcher.finditer(text)] == [
        m.span() for m in reference.finditer(text)
    ]


# --- the self-check -----------------------------------------------------------------------


def test_self_check_turns_the_cache_off_where_segmenting_changes_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Metaspace with ``prepend_scheme="first"`` prepends "▁" to the text's first piece
    only; encoded alone, the text after a special token is a first piece too."""
    tokenizer = metaspace("first")
    text, inst = "hello[INST]world", tokenizer.token_to_id("[INST]")
    blind_cut = [*whole(tokenizer, "hello", False), inst, *whole(tokenizer, "world", False)]
    assert blind_cut != whole(tokenizer, text, False)

    cache = SegmentCache(100_000, min_segment_chars=4)
    with caplog.at_level(logging.INFO, logger="router.token_segments"):
        assert SegmentedEncoder.build(tokenizer, cache, name="first-scheme") is None
        cached = model_tokenizer(tokenizer, cache)
    assert not cached.segment_caching
    assert "first-scheme: prompt segment cache off" in caplog.text
    for add_special_tokens in (False, True):
        got = cached.completion_token_ids(
            text + long_text(6), add_special_tokens=add_special_tokens, cache_scope=ANONYMOUS
        )
        assert got == whole(tokenizer, text + long_text(6), add_special_tokens)
    assert cache.stats().misses == 0  # never consulted


def test_tokens_that_strip_whitespace_are_not_cut_tokens() -> None:
    """``<mask>`` (``lstrip`` and ``rstrip``, as RoBERTa's) eats the spaces around it: a
    cut there would leave them to the text beside it; it is matched but never cut at."""
    tokenizer = chatml_byte_level()
    tokenizer.add_special_tokens([AddedToken("<mask>", special=True, lstrip=True, rstrip=True)])
    mask = tokenizer.token_to_id("<mask>")
    text = "hello   <mask>  world"
    blind_cut = [*whole(tokenizer, "hello   ", False), mask, *whole(tokenizer, "  world", False)]
    assert blind_cut != whole(tokenizer, text, False)
    encoder = SegmentedEncoder.build(tokenizer, SegmentCache(10_000, min_segment_chars=2))
    assert encoder is not None
    assert "<mask>" not in encoder.cut_tokens and "<|im_end|>" in encoder.cut_tokens
    for sample in [text, "a <|im_end|>   <mask> b", "<mask>   <|im_end|>  <mask>\n"]:
        for add_special_tokens in (False, True):
            want = whole(tokenizer, sample, add_special_tokens)
            assert encoder.segmented_ids(sample, add_special_tokens=add_special_tokens) == want
            got = encoder.encode(sample, add_special_tokens=add_special_tokens, scope=ANONYMOUS)
            assert got == want


def test_truncation_turns_the_cache_off() -> None:
    tokenizer = chatml_byte_level()
    tokenizer.enable_truncation(64)
    assert SegmentedEncoder.build(tokenizer, SegmentCache(1000)) is None


# --- the LRU --------------------------------------------------------------------------------


def _key(n: int, scope: CacheScope = ANONYMOUS) -> tuple[int, CacheScope, bytes]:
    return (0, scope, n.to_bytes(32, "big"))


def test_lru_stays_within_its_token_bound() -> None:
    cache = SegmentCache(1000)
    ids = tuple(range(92))  # charged 100 with the per-entry overhead
    assert len(ids) + ENTRY_OVERHEAD_TOKENS == 100
    for n in range(10):
        cache.put(_key(n), ids)
    assert cache.stats().charged_tokens == 1000 and cache.stats().evictions == 0
    assert cache.get(_key(0)) == ids  # now the most recent
    cache.put(_key(10), ids)
    assert cache.get(_key(1)) is None  # the least recent went
    assert cache.get(_key(0)) == ids
    cache.put(_key(11), tuple(range(492)))  # 500: five more go
    stats = cache.stats()
    assert stats.charged_tokens <= 1000 and stats.evictions == 6 and stats.entries == 6
    cache.put(_key(12), tuple(range(993)))  # 1001 alone: never stored
    assert cache.get(_key(12)) is None and cache.stats().charged_tokens <= 1000
    cache.put(_key(11), tuple(range(92)))  # a replacement is charged once
    assert cache.stats().charged_tokens == 100 * 6


def test_lru_bound_under_concurrent_tokenizing() -> None:
    """Threads encoding overlapping documents through a cache that holds about two of
    them: every answer equals the whole encoding, the bound holds, entries get evicted."""
    tokenizer = TOKENIZERS["chatml_byte_level"]
    cache = SegmentCache(5000, min_segment_chars=1000)
    encoder = SegmentedEncoder.build(tokenizer, cache)
    assert encoder is not None
    documents = [long_text(seed, 6000) for seed in range(6)]
    texts = [f"<|im_start|>{d}<|im_end|>q{i}" for i, d in enumerate(documents * 4)]
    wanted = [whole(tokenizer, text, True) for text in texts]

    def encode(text: str) -> list[int]:
        return encoder.encode(text, add_special_tokens=True, scope=ANONYMOUS)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(encode, texts * 2)) == wanted * 2
    stats = cache.stats()
    assert stats.charged_tokens <= 5000 and stats.evictions > 0
    chunks_per_pass = sum(num_chunks(tokenizer, document) for document in documents * 4)
    assert stats.hits + stats.misses == chunks_per_pass * 2


# --- tenant isolation ----------------------------------------------------------------------


def test_tenants_and_cache_salts_never_share_an_entry() -> None:
    """Through the seam: the same long document is a miss for each (tenant, cache_salt)
    the first time, a hit only for the scope that stored it."""
    cache = SegmentCache(1_000_000)
    tokenizer = ModelTokenizer.from_dir(model_dir("tiny"), segment_cache=cache)
    document = long_text(7, 10_000)
    chunks = num_chunks(tokenizer.tokenizer, document)

    async def main() -> None:
        pool = TokenizePool(1)
        local = LocalPromptTokenizer(tokenizer, pool)
        try:
            for tenant, salt, hit in [
                ("alice", None, False),
                ("alice", None, True),
                ("bob", None, False),
                (None, None, False),  # anonymous is a scope of its own
                ("alice", "salt-1", False),
                ("alice", "salt-1", True),
                (None, "salt-1", False),
                ("bob", None, True),
            ]:
                body: dict[str, Any] = {
                    "messages": [
                        {"role": "system", "content": document},
                        {"role": "user", "content": f"question for {tenant}"},
                    ]
                }
                if salt is not None:
                    body["cache_salt"] = salt
                before = cache.stats()
                ids = await local.token_ids("chat", body, size_hint=20_000, tenant=tenant)
                assert ids == tokenizer.chat_request_token_ids(body)
                after = cache.stats()
                found, missed = after.hits - before.hits, after.misses - before.misses
                # every chunk of the document found, or every one missed
                assert (found, missed) == ((chunks, 0) if hit else (0, chunks)), (tenant, salt)
        finally:
            pool.close()

    run(main())
    assert cache.stats().entries == 5 * chunks


def test_engine_backend_keeps_tenants_apart() -> None:
    """The engine backend's LRU is tenant-scoped too: another tenant's identical request
    goes to the engine again."""
    calls: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        calls.append(await request.json())
        return web.json_response({"tokens": [1, 2, 3], "count": 3, "max_model_len": 100})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        runner, url = await start_server(app, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                adapter = ENGINES["vllm"]
                engine = EnginePromptTokenizer("m", lambda _: [(url, adapter)], lambda: session)
                body = {"prompt": "same prompt"}
                for tenant in ["alice", "alice", "bob", None, "bob"]:
                    await engine.token_ids("completion", body, size_hint=0, tenant=tenant)
                assert engine.num_engine_calls == 3
        finally:
            await runner.cleanup()

    run(main())
    assert len(calls) == 3


# --- configuration and metrics ---------------------------------------------------------------


def test_config_sizes_the_shared_cache_and_metrics_count_it() -> None:
    assert RouterConfig().tokenize_cache_tokens == 2_000_000
    registry = TokenizerRegistry(
        RouterConfig(tokenize_cache_tokens=0), endpoints=lambda _: [], session=no_session
    )
    assert registry.segment_cache is None and registry.segment_cache_stats() is None
    registry.close()

    folder = str(model_dir("tiny"))
    config = RouterConfig(tokenize_cache_tokens=50_000, tokenizers={"m": folder})
    registry = TokenizerRegistry(config, endpoints=lambda _: [], session=no_session)
    local = registry.resolve("m", None)
    assert isinstance(local, LocalPromptTokenizer) and local.tokenizer.segment_caching
    for _ in range(2):
        local.tokenizer.completion_token_ids(long_text(8), cache_scope=ANONYMOUS)
    chunks = num_chunks(local.tokenizer.tokenizer, long_text(8))
    metrics = RouterMetrics()
    metrics.add_tokenize_cache_collector(registry.segment_cache_stats)
    text = metrics.render().decode()
    registry.close()
    assert f"kvroute_router_tokenize_cache_hits_total {chunks:.1f}" in text
    assert f"kvroute_router_tokenize_cache_misses_total {chunks:.1f}" in text
    assert "kvroute_router_tokenize_cache_evictions_total 0.0" in text
    assert "kvroute_router_tokenize_cache_tokens " in text
