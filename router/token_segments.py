"""Token ids of long prompt segments, cached: a long document sent again is not re-tokenized.

A *cut token* is a special added token of the tokenizer (``<|im_start|>``, ``<|end|>``,
...). Hugging Face ``tokenizers`` extracts added tokens from the raw text before it
normalizes and pre-tokenizes, and works on the pieces between them separately, so for
most tokenizers, without the post-processor (BOS/EOS)::

    encode(a + CUT + b) == encode(a) + [id(CUT)] + encode(b)

A *segment* is the text between two cut tokens (or the text's start or end). A segment of
at least ``SegmentCache.min_segment_chars`` characters is looked up in ``SegmentCache`` by
(tokenizer, ``CacheScope``, blake2b-256 of its text) and encoded only on a miss; everything
else (short segments, the cut tokens) is encoded each time, and the post-processor's
tokens are put around the whole, so the ids are those of encoding the whole text.

Invariant: ``SegmentedEncoder.encode(text, ...)`` equals encoding ``text`` whole. It holds
by construction for the tokenizers ``SegmentedEncoder.build`` accepts, and ``build``
checks it: it refuses (returns None, logs why at INFO) a tokenizer with truncation,
padding, BPE dropout or ``encode_special_tokens``, one whose post-processor does not just
add fixed ids around the text, and one that encodes any of a fixed set of sample texts
(whitespace and newlines next to cut tokens, ...) differently when segmented; for example
a ``Metaspace`` pre-tokenizer with ``prepend_scheme="first"`` (the "first" piece differs).
A special token that strips adjacent whitespace (``lstrip``/``rstrip``), matches only
whole words, is normalized, or starts or ends with whitespace is never a cut token.

*Line cuts*: a long segment is cut further into chunks of at least
``SegmentCache.chunk_chars`` characters, each cached on its own, right after a newline
whose next character is not whitespace (rule ``after_newlines``), or where the tokenizer
needs it only after a newline between two such characters (``lone_newline``: GPT-2's
regex makes a whitespace run at a text's end one pre-token more than inside the text).
The common pre-tokenizers (GPT-2's and Llama 3's byte-level regexes, BERT's, ...) never
join a newline to the word after it, so encoding the chunks one by one gives the ids of
encoding the segment whole; a document
followed by a new question in the same text then misses only its last chunk, and a new
document's chunks encode in parallel. Line cuts are on only for a tokenizer whose added
tokens all match their own characters without stripping whitespace (a cut beside one that
strips would move a newline) and that passes a second self-check (newlines before words,
digits, punctuation, CJK, emoji, markup; a ``Metaspace`` or ``Prepend`` tokenizer, or
``add_prefix_space``, fails it: each chunk would get its own prefix). Cut positions depend
only on the text before them and the character after, so a text that starts with a
cached text reuses every chunk but the cached text's last.

Tenant isolation: the scope (tenant id and ``cache_salt``) is part of every key, so a
request can only hit entries its own scope stored; neither its ids nor its timing depend
on another scope's texts. Capacity is shared: another scope's traffic can evict an entry
(which tells its volume, never its content). Keys are digests; no text is kept or logged.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenizers import AddedToken, Tokenizer

log = logging.getLogger(__name__)

GIL_RELEASE_MIN_CHARS = 4096  # shorter texts encode in microseconds, GIL or not
SEGMENT_MIN_CHARS = 4096  # shorter segments are encoded each time
CHUNK_CHARS = 4096  # a long segment is cut at the first line cut past every 4,096 characters
# Where a segment may be cut inside its text, most cuts first (see the module docstring):
# after any run of newlines (Llama 3 / Qwen / GPT-4o regexes keep a newline run one
# pre-token), or only after a newline between two characters that are not whitespace
# (GPT-2's regex gives a whitespace run at the text's end one pre-token more).
LineCutRule = Literal["after_newlines", "lone_newline"]
LINE_CUT_RULES: tuple[LineCutRule, ...] = ("after_newlines", "lone_newline")
# Charged per entry on top of its tokens: key tuple, 32-byte digest, LRU node, tuple header
# (about 350 bytes, in units of a cached token's ~40 bytes).
ENTRY_OVERHEAD_TOKENS = 8

# Sample texts of the self-check; {0} {1} are cut tokens, {2} an added token that is not
# one (or ""). Whitespace and newlines next to the tokens are where tokenizers differ.
_SELF_CHECK_TEXTS = (
    "{0}hello world{1}",
    "hello{0}world",
    "hello {0} world",
    " leading space{0} trailing space ",
    "line one\n{0}\nline two\n",
    "\n\n{0}\n\n{1}\n\n",
    "tabs\t{0}\tand  double  spaces  {1}  end",
    "{0}{1}{0}",
    "{0} {1}",
    "   {0}   ",
    "word{0}word {1} word",
    "Ünïcödé → 中文 {0}😀 emoji{1}é",
    "x {2}{0}{2} y{1}",
    "{2} {0} {2}",
    "{0}",
    "plain text without any cut token\n",
)
# Line cuts (after "\n", before a character that is not whitespace): what may follow one.
_LINE_CUT_CHECK_TEXTS = (
    "one\ntwo\n\nthree\r\nfour\n \nfive\n",
    "Title\nThe quick brown fox.\n\n's 're 've 'd n't\n\"quoted\"\n(paren)\n",
    "1. first\n2. second\n10,000 items\n3.14159\n-1\n+2\n#3\n",
    "code:\n    indented\n\tx = cache.get(key)\n}\n{\n<tag attr=1>\n</tag>\n",
    "Ünïcödé\nÉcole\n中文字符\n日本語\n😀 emoji\n→ arrow\n•bullet\n—dash\n",
    "a\nb\nc\nA\nB\nZ\n_\n$\n@\n!\n?\n.\n,\n;\n:\n/\n\\\n|\n~\n`\n",
    "ends with newline\n\n\nX",
)
_EVERY_TOKEN_TEXT = " a {0}  b\n{0}\nc{0}{1} "  # once per cut token, in one text
_AFFIX_PROBE = "Hello world"
_MAX_SELF_CHECK_TOKENS = 4
_namespaces = itertools.count()  # one per SegmentedEncoder: tokenizers never share entries
_Trie = dict[str, "_Trie"]  # char -> subtrie; "" -> {}: a literal ends here


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Who may reuse a cached segment: requests of the same tenant (None: anonymous) with
    the same ``cache_salt`` (None: none)."""

    tenant: str | None
    cache_salt: str | None


CacheKey = tuple[int, CacheScope, bytes]  # (tokenizer namespace, scope, segment digest)


@dataclass(frozen=True, slots=True)
class SegmentCacheStats:
    hits: int  # long segments found
    misses: int  # long segments encoded (stored unless larger than the cache)
    evictions: int  # entries dropped to stay under max_tokens
    entries: int
    charged_tokens: int  # cached tokens + ENTRY_OVERHEAD_TOKENS per entry
    max_tokens: int


class SegmentCache:
    """LRU of long segments' token ids, bounded by tokens; safe to share between threads
    (one lock around the dict operations, never held while encoding).

    Invariant: after every call, ``charged_tokens <= max_tokens``, where an entry is
    charged its token count plus ``ENTRY_OVERHEAD_TOKENS``. Ids are kept as tuples: a
    hit is copied into the result at C speed (``array('i')`` is 10x smaller but turning
    it back into ints cost 5 ms per 128K tokens of a 150K vocabulary, a tuple 0.2 ms).
    Memory: about 40 bytes per charged token (an 8-byte slot and a 32-byte int object;
    ids below 257 are shared ints), so the default 2M tokens is at most about 80 MB.
    """

    def __init__(
        self,
        max_tokens: int,
        *,
        min_segment_chars: int = SEGMENT_MIN_CHARS,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        if max_tokens < 1 or min_segment_chars < 1 or chunk_chars < 1:
            raise ValueError("max_tokens, min_segment_chars and chunk_chars must be at least 1")
        self.max_tokens = max_tokens
        self.min_segment_chars = min_segment_chars
        self.chunk_chars = chunk_chars  # line cuts: see the module docstring
        self._entries: OrderedDict[CacheKey, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._charged = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def get(self, key: CacheKey) -> tuple[int, ...] | None:
        """The ids stored under ``key`` (now the most recent entry), or None; counted."""
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self._misses += 1
                return None
            self._hits += 1
            self._entries.move_to_end(key)
            return ids

    def put(self, key: CacheKey, ids: tuple[int, ...]) -> None:
        """Store ``ids`` as the most recent entry, evicting the least recent beyond the
        bound; ids that alone exceed it are not stored."""
        cost = _charge(ids)
        if cost > self.max_tokens:
            return
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                self._charged -= _charge(replaced)
            self._entries[key] = ids
            self._charged += cost
            while self._charged > self.max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self._charged -= _charge(evicted)
                self._evictions += 1

    def stats(self) -> SegmentCacheStats:
        with self._lock:
            return SegmentCacheStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                entries=len(self._entries),
                charged_tokens=self._charged,
                max_tokens=self.max_tokens,
            )


def _charge(ids: tuple[int, ...]) -> int:
    return len(ids) + ENTRY_OVERHEAD_TOKENS


def encode_text(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer``'s ids of ``text``, the GIL released for long texts.

    NOTE: ``encode_batch_fast`` releases the GIL while the Rust tokenizer runs, ``encode``
    holds it; a long text encoded on a worker thread must not stall the event loop. The
    fast variant skips the offsets (unused here): same ids, 2-3x faster on long prompts
    (36 -> 18 ms for 128K tokens, BENCHMARKS.md).
    """
    if len(text) < GIL_RELEASE_MIN_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    (encoding,) = tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
    return encoding.ids


def _encode_pieces(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Ids of each text, no post-processor; one GIL-free batch when any text is long."""
    if all(len(text) < GIL_RELEASE_MIN_CHARS for text in texts):
        return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


@dataclass(slots=True)
class _Piece:
    """A stretch of the text: a long segment (cacheable) or the text between long
    segments (cut tokens and short segments, encoded each time)."""

    text: str
    is_segment: bool
    key: CacheKey | None = None  # set once the segment is looked up
    ids: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class _Affixes:
    """The post-processor's ids around a single sequence (``add_special_tokens=True``)."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]


class SegmentedEncoder:
    """One tokenizer's encoding through ``SegmentCache`` (see the module docstring).

    Build it with ``SegmentedEncoder.build``, which runs the self-check; immutable after
    that, and thread-safe (the cache has its own lock, the tokenizer encodes concurrently).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        cache: SegmentCache,
        *,
        added_tokens: Iterable[AddedToken],
        affixes: _Affixes,
    ) -> None:
        tokens = [t for t in added_tokens if t.content]
        self._tokenizer = tokenizer
        self._cache = cache
        self._namespace = next(_namespaces)
        self._affixes = affixes
        # NOTE: the matcher finds every added token tokenizers extracts from the raw text
        # (leftmost-longest, as its Aho-Corasick scan), so a cut is never put inside a
        # longer added token; only the matches that are cut tokens cut.
        self._matcher = _literal_matcher(t.content for t in tokens if not t.normalized)
        self.cut_tokens = frozenset(t.content for t in tokens if _can_cut(t))
        self.other_tokens = frozenset(t.content for t in tokens) - self.cut_tokens
        # line cuts (module docstring): only beside added tokens that strip nothing; set by
        # ``build``'s second self-check (None: no line cuts)
        self.line_cut_rule: LineCutRule | None = None
        self._line_cuts_allowed = all(_matches_itself(t) for t in tokens)

    @classmethod
    def build(
        cls, tokenizer: Tokenizer, cache: SegmentCache, *, name: str = "", hint: str = ""
    ) -> SegmentedEncoder | None:
        """An encoder for ``tokenizer``, or None (logged at INFO) when segmenting is unsafe
        for it (see the module docstring). ``hint``: text whose cut tokens the self-check
        tries first (the chat template)."""
        reason = _unsupported_reason(tokenizer)
        if reason is None:
            affixes = _post_processor_affixes(tokenizer)
            if affixes is None:
                reason = "its post-processor does more than add fixed ids"
            else:
                added = tokenizer.get_added_tokens_decoder().values()
                encoder = cls(tokenizer, cache, added_tokens=added, affixes=affixes)
                if encoder.self_check(hint):
                    encoder._choose_line_cut_rule(hint, name)
                    return encoder
                reason = "segmenting at special tokens changes its token ids"
        log.info("tokenizer %s: prompt segment cache off (%s)", name or "?", reason)
        return None

    def encode(self, text: str, *, add_special_tokens: bool, scope: CacheScope) -> list[int]:
        """The ids of encoding ``text`` whole; long segments come from the cache when
        ``scope`` stored them before."""
        if len(text) < self._cache.min_segment_chars:
            return encode_text(self._tokenizer, text, add_special_tokens=add_special_tokens)
        pieces = self._pieces(text, self._cache.min_segment_chars)
        if not any(piece.is_segment for piece in pieces):
            return encode_text(self._tokenizer, text, add_special_tokens=add_special_tokens)
        for piece in pieces:
            if piece.is_segment:
                piece.key = (self._namespace, scope, _digest(piece.text))
                piece.ids = self._cache.get(piece.key)
        for piece in self._encode_missing(pieces):
            if piece.key is not None and piece.ids is not None:
                piece.ids = tuple(piece.ids)
                self._cache.put(piece.key, piece.ids)
        return self._join(pieces, add_special_tokens)

    def segmented_ids(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids with a cut at every cut token (and every line cut when they are on),
        nothing cached: the self-check's (and the tests') comparison with encoding
        ``text`` whole."""
        pieces = self._pieces(text, min_chars=1, chunk_chars=1)
        self._encode_missing(pieces)
        return self._join(pieces, add_special_tokens)

    def _choose_line_cut_rule(self, hint: str, name: str) -> None:
        """Turn on the first rule of ``LINE_CUT_RULES`` that passes the self-check with the
        line-cut samples, if any (once, in ``build``)."""
        for rule in LINE_CUT_RULES if self._line_cuts_allowed else ():
            self.line_cut_rule = rule
            if self.self_check(hint, line_cut_texts=True):
                return
        self.line_cut_rule = None
        log.info("tokenizer %s: prompt segments are cut only at special tokens", name or "?")

    def self_check(self, hint: str = "", *, line_cut_texts: bool = False) -> bool:
        """True when every self-check text encodes alike whole and segmented (both
        ``add_special_tokens`` values); with ``line_cut_texts`` the line-cut samples too."""
        texts = self._self_check_texts(hint)
        if line_cut_texts:
            # and added tokens right after a line cut
            beside = sorted(self.cut_tokens)[:1] + sorted(self.other_tokens)[:1]
            texts += [*_LINE_CUT_CHECK_TEXTS, *(f"x\n{t}y\n{t}\nz {t}\n" for t in beside)]
        for text in texts:
            for add_special_tokens in (False, True):
                whole = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
                if self.segmented_ids(text, add_special_tokens=add_special_tokens) != whole:
                    return False
        return True

    # --- internal helpers ---------------------------------------------------------------

    def _self_check_texts(self, hint: str) -> list[str]:
        """The samples with the first few cut tokens (those in ``hint`` first) and the
        first added token that is not one; then one text with every cut token."""
        cut = sorted(self.cut_tokens, key=lambda t: (t not in hint, self._id(t), t))
        other = min(self.other_tokens, key=self._id, default="")
        every_token = "".join(_EVERY_TOKEN_TEXT.format(token, other) for token in cut)
        first = cut[:_MAX_SELF_CHECK_TOKENS] or [""]
        pairs = [(token, first[(i + 1) % len(first)]) for i, token in enumerate(first)]
        texts = [t.format(a, b, other) for (a, b), t in itertools.product(pairs, _SELF_CHECK_TEXTS)]
        return [*texts, every_token]

    def _id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        return -1 if token_id is None else token_id

    def _pieces(self, text: str, min_chars: int, chunk_chars: int | None = None) -> list[_Piece]:
        """``text`` as runs and long segments (at least ``min_chars`` characters between
        cut tokens; with line cuts on, cut into chunks of at least ``chunk_chars``, default
        the cache's), in order; together exactly ``text``."""
        pieces: list[_Piece] = []
        rule = self.line_cut_rule
        chunk = (chunk_chars or self._cache.chunk_chars) if rule else None
        run_start = segment_start = 0
        for match in self._matcher.finditer(text) if self._matcher else ():
            if match.group() not in self.cut_tokens:
                continue
            if match.start() - segment_start >= min_chars:
                _add_segment(pieces, text, run_start, segment_start, match.start(), chunk, rule)
                run_start = match.start()
            segment_start = match.end()
        if len(text) - segment_start >= min_chars:
            _add_segment(pieces, text, run_start, segment_start, len(text), chunk, rule)
            run_start = len(text)
        if run_start < len(text) or not pieces:
            pieces.append(_Piece(text[run_start:], is_segment=False))
        return pieces

    def _encode_missing(self, pieces: list[_Piece]) -> list[_Piece]:
        """Encode the pieces without ids (runs, cache misses); returns them."""
        missing = [p for p in pieces if p.ids is None]
        for piece, ids in zip(
            missing, _encode_pieces(self._tokenizer, [p.text for p in missing]), strict=True
        ):
            piece.ids = ids
        return missing

    def _join(self, pieces: list[_Piece], add_special_tokens: bool) -> list[int]:
        ids: list[int] = list(self._affixes.prefix) if add_special_tokens else []
        for piece in pieces:
            assert piece.ids is not None
            ids.extend(piece.ids)
        if add_special_tokens:
            ids.extend(self._affixes.suffix)
        return ids


def _add_segment(
    pieces: list[_Piece],
    text: str,
    run_start: int,
    start: int,
    end: int,
    chunk_chars: int | None,
    rule: LineCutRule | None,
) -> None:
    """Append the run before a long segment (when not empty), then the segment: whole, or
    (``rule`` and ``chunk_chars`` set) as its line-cut chunks."""
    if run_start < start:
        pieces.append(_Piece(text[run_start:start], is_segment=False))
    if chunk_chars is None or rule is None:
        pieces.append(_Piece(text[start:end], is_segment=True))
        return
    for cut in line_cuts(text, start, end, chunk_chars, rule):
        pieces.append(_Piece(text[start:cut], is_segment=True))
        start = cut
    pieces.append(_Piece(text[start:end], is_segment=True))


def line_cuts(text: str, start: int, end: int, chunk_chars: int, rule: LineCutRule) -> list[int]:
    """Cut positions in ``text[start:end]``, ascending: each the first line cut of ``rule``
    (right after a newline, before a character that is not whitespace; with
    ``"lone_newline"`` also after one) at least ``chunk_chars`` past the previous cut (or
    ``start``). NOTE: a position depends only on the text before it and the character
    after it, so texts that share a beginning share their cuts in it."""
    lone = rule == "lone_newline"
    cuts: list[int] = []
    newline = text.find("\n", start + chunk_chars - 1, end - 1)
    while newline != -1:
        cut = newline + 1
        if text[cut].isspace() or (lone and newline > start and text[newline - 1].isspace()):
            newline = text.find("\n", cut, end - 1)
            continue
        cuts.append(cut)
        newline = text.find("\n", cut + chunk_chars - 1, end - 1)
    return cuts


def _digest(segment: str) -> bytes:
    # NOTE: "surrogatepass": a JSON body may hold lone surrogates; hashing must not be what
    # fails (the tokenizer refuses such text with its own error, as without the cache).
    return hashlib.blake2b(segment.encode("utf-8", "surrogatepass"), digest_size=32).digest()


def _can_cut(token: AddedToken) -> bool:
    """A special token matched in the raw text, exactly its own characters."""
    content = token.content
    return token.special and _matches_itself(token) and content.strip() == content


def _matches_itself(token: AddedToken) -> bool:
    """An added token matched in the raw text as exactly its own characters: no
    whitespace stripped around it, not only as a whole word, not normalized first."""
    return not (token.normalized or token.lstrip or token.rstrip or token.single_word)


def _unsupported_reason(tokenizer: Tokenizer) -> str | None:
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return "truncation or padding is on"
    if tokenizer.encode_special_tokens:
        return "encode_special_tokens is on"
    if getattr(tokenizer.model, "dropout", None):
        return "BPE dropout is on"
    return None


def _post_processor_affixes(tokenizer: Tokenizer) -> _Affixes | None:
    """The ids the post-processor puts before and after a text, or None when encoding
    with them is not ``prefix + ids + suffix`` for the probe text."""
    bare = tokenizer.encode(_AFFIX_PROBE, add_special_tokens=False).ids
    full = tokenizer.encode(_AFFIX_PROBE, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return _Affixes(tuple(full[:start]), tuple(full[start + len(bare) :]))
    return None


def _literal_matcher(literals: Iterable[str]) -> re.Pattern[str] | None:
    """A regex finding the leftmost-longest of ``literals``, shaped as a trie: a scan costs
    about one step per character even when many literals share a first character (an
    alternation tries each one: 9 ms for 207 tokens over 160K characters full of "<")."""
    trie: _Trie = {}
    for literal in set(literals):
        node = trie
        for char in literal:
            node = node.setdefault(char, {})
        node[""] = {}
    return re.compile(_trie_pattern(trie)) if trie else None


def _trie_pattern(node: _Trie) -> str:
    """Regex of a trie node; a literal ending here is the last, optional choice (greedy
    ``?`` tries the longer literals first: leftmost-longest)."""
    branches = []
    for char in sorted(k for k in node if k):
        literal, child = re.escape(char), node[char]
        while len(child) == 1 and "" not in child:  # a chain: one literal, no group
            [(next_char, child)] = child.items()
            literal += re.escape(next_char)
        branches.append(literal + _trie_pattern(child))
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    return f"(?:{body})?" if "" in node else body
