"""Compiling constraints into xgrammar grammars, cached and off the step's critical path.

xgrammar (and the torch it imports) is imported on the first request that asks for
structured output, so ``import cadence`` and engines that never use it stay light.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cadence.structured_output.params import StructuredOutputsParams, choice_grammar
from cadence.structured_output.schema_support import unsupported_schema_feature

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_ERROR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_MAX_CACHED = 512


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured output needs xgrammar, which is not installed: "
                         "pip install xgrammar (or cadence[structured])") from e
    return xgrammar


# The character class xgrammar writes for the characters of a string with a min/maxLength:
# unlike its other strings' ``[^\0-\x1f"\\\r\n]``, it lets raw control characters
# through, which JSON does not allow in a string (json.loads and JSON.parse refuse them).
_LENGTH_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def json_schema_grammar(xgr: Any, schema: str, any_whitespace: bool) -> Any:
    """xgrammar's grammar of ``schema``, its strings held to JSON's characters; without
    ``any_whitespace``, compact (``{"a":1,"b":[2,3]}``), as vLLM lays it out. A keyword
    xgrammar would not enforce is a ValueError (schema_support.py)."""
    try:
        parsed = json.loads(schema)
    except ValueError:
        parsed = None  # xgrammar names what is wrong with it
    unsupported = unsupported_schema_feature(parsed)
    if unsupported is not None:
        raise ValueError(f"the schema uses {unsupported}, which the grammar engine "
                         "(xgrammar) would not enforce, so an output could break the "
                         "schema; leave it out or check it after generation")
    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace,
        separators=None if any_whitespace else (",", ":"))
    ebnf = str(grammar)
    if _LENGTH_CHARS not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LENGTH_CHARS, _JSON_CHARS))


def grammar_of(xgr: Any, text: str) -> Any:
    """A grammar in xgrammar's EBNF (GBNF: ``root ::= ...``), or in Lark's syntax
    (``start: ...``), as vLLM tells them apart: Lark where no rule is written with
    ``::=``."""
    if "::=" not in text and _LARK_RULE.search(text):
        try:
            return xgr.Grammar.from_lark(text)
        except Exception as e:  # noqa: BLE001 - xgrammar's C++ errors
            raise ValueError(f"(read as a Lark grammar, having no '::=' rule) "
                             f"{_clean(e)}") from None
    return xgr.Grammar.from_ebnf(text)


# A Lark rule or terminal definition at the start of a line: "start:", "?expr:", "NAME:".
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*:", re.MULTILINE)


def _clean(error: BaseException) -> str:
    text = str(error).strip()
    return _ERROR_PREFIX.sub("", text.splitlines()[0] if text else type(error).__name__)


class GrammarCompiler:
    """One per engine: the tokenizer's xgrammar view, and compiled grammars by constraint.

    ``validate`` parses a constraint at once (cheap; a bad schema, regex or grammar is a
    ValueError before the request is accepted); ``submit`` compiles it against the
    vocabulary on a worker thread (expensive: a pass over every token), deduplicated and
    cached by the constraint.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._xgr = import_xgrammar()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cadence-grammar")
        self._compiler: Any = None
        self._cache: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem if ``params`` cannot be parsed."""
        g = self._xgr.Grammar
        kind = params.kind
        try:
            if kind == "json":
                # What _compile compiles: a schema whose rewritten grammar failed to parse
                # back is refused now, not when its request is already queued.
                json_schema_grammar(self._xgr, params.spec, not params.disable_any_whitespace)
            elif kind == "regex":
                g.from_regex(params.regex)
            elif kind == "choice":
                g.from_ebnf(choice_grammar(params.choice))
            elif kind == "grammar":
                grammar_of(self._xgr, params.grammar)
        except Exception as e:  # xgrammar raises RuntimeError (and others) from C++
            raise ValueError(f"structured_outputs.{kind} is invalid: {_clean(e)}") from None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (cached: the same constraint compiles once)."""
        key = params.cache_key
        with self._lock:
            fut = self._cache.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                if len(self._cache) >= _MAX_CACHED:
                    self._cache.pop(next(iter(self._cache)))
                fut = self._pool.submit(self._compile, params)
                self._cache[key] = fut
            return fut

    def _compile(self, params: StructuredOutputsParams) -> Any:
        if self._compiler is None:
            # Built on the pool's thread: a pass over the vocabulary, off the step loop.
            info = self._xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = self._xgr.GrammarCompiler(info, max_threads=2)
        c = self._compiler
        kind = params.kind
        try:
            if kind == "json":
                return c.compile_grammar(json_schema_grammar(
                    self._xgr, params.spec, not params.disable_any_whitespace))
            if kind == "json_object":  # any JSON object, as vLLM compiles it
                return c.compile_grammar(json_schema_grammar(
                    self._xgr, '{"type": "object"}', not params.disable_any_whitespace))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(params.choice))
            return c.compile_grammar(grammar_of(self._xgr, params.grammar))
        except Exception as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {_clean(e)}") \
                from None

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
