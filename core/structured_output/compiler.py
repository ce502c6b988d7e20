"""Compiling constraints into xgrammar grammars, cached and off the step's critical path.

xgrammar (and the torch it imports) is imported on the first request that asks for
structured output, so ``import cadence`` and engines that never use it stay light.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cadence.structured_output.params import StructuredOutputsParams, choice_grammar

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
    """xgrammar's grammar of ``schema``, its strings held to JSON's characters."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    ebnf = str(grammar)
    if _LENGTH_CHARS not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LENGTH_CHARS, _JSON_CHARS))


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
                g.from_ebnf(params.grammar)
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
                return c.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(params.choice))
            return c.compile_grammar(params.grammar)
        except Exception as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {_clean(e)}") \
                from None

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
