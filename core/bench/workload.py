"""What a benchmark generates: the prompts, output lengths and sampling parameters every run
of a comparison shares (``Workload``), read from the command line, and the host work,
structured output and prompt kinds it can ask for.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from cadence.bench.texts import PROMPT_KINDS, edit_prompts

HOST_WORK = ("light", "heavy")
# "heavy" host work: ten stop strings that never match (every token is checked against all
# of them) plus the top-5 logprobs of every token.
HEAVY_STOP = [f"<<cadence-never-{i}>>" for i in range(10)]
HEAVY_LOGPROBS = 5
# --structured-output: constraints that never force an early end (records of any count and
# length), so the run measures the cost of the bitmask at the workload's usual lengths.
STRUCTURED = ("none", "json", "regex")
BENCH_SCHEMA = {"type": "object", "required": ["records"], "properties": {"records": {
    "type": "array", "items": {"type": "object", "required": ["id", "name", "tags"],
                               "properties": {"id": {"type": "integer"},
                                              "name": {"type": "string"},
                                              "tags": {"type": "array",
                                                       "items": {"type": "string"}}}}}}}
# Unbounded on purpose: xgrammar expands a bounded repetition such as {1,100000}, and its
# bitmask then cost ~18 ms a row per step on the default model's vocabulary (``+``: 0.05 ms).
BENCH_REGEX = r"([A-Za-z0-9]+[ ,.])+"


@dataclass(slots=True)
class Workload:
    """What is generated: the same prompts and lengths for every run of a comparison."""

    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 64
    output_len_range: tuple[int, int] | None = None
    seed: int = 0
    host_work: str = "light"
    detokenize: bool = True
    temperature: float = 1.0
    structured_output: str = "none"
    # "random": random token ids of input_len; "edit": requests to return a passage with its
    # spelling corrected (texts.py), whose answers repeat the prompt.
    prompt_kind: str = "random"

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.host_work not in HOST_WORK:
            raise ValueError(f"host_work must be one of {HOST_WORK}, got {self.host_work!r}")
        if self.host_work == "heavy" and not self.detokenize:
            raise ValueError("host_work='heavy' uses stop strings, which need detokenization;"
                             " drop --disable-detokenize")
        if self.structured_output not in STRUCTURED:
            raise ValueError(f"structured_output must be one of {STRUCTURED}, got "
                             f"{self.structured_output!r}")
        if self.prompt_kind not in PROMPT_KINDS:
            raise ValueError(f"prompt_kind must be one of {PROMPT_KINDS}, got "
                             f"{self.prompt_kind!r}")
        r = self.output_len_range
        if r is not None and not 1 <= r[0] <= r[1]:
            raise ValueError(f"output_len_range must be A:B with 1 <= A <= B, got {r}")

    def prompts(self, vocab_size: int, tokenizer: Any = None) -> list[list[int]]:
        if self.prompt_kind == "edit":
            return edit_prompts(tokenizer, self.num_prompts, self.seed)
        rng = random.Random(self.seed)
        return [[rng.randrange(vocab_size) for _ in range(self.input_len)]
                for _ in range(self.num_prompts)]

    def output_lens(self) -> list[int]:
        if self.output_len_range is None:
            return [self.output_len] * self.num_prompts
        rng = random.Random(self.seed + 1)
        lo, hi = self.output_len_range
        return [rng.randint(lo, hi) for _ in range(self.num_prompts)]

    def sampling_params(self, max_tokens: int) -> Any:
        from cadence.sampling_params import SamplingParams
        from cadence.structured_output.params import StructuredOutputsParams

        heavy = self.host_work == "heavy"
        so = None
        if self.structured_output == "json":
            so = StructuredOutputsParams(json=BENCH_SCHEMA)
        elif self.structured_output == "regex":
            so = StructuredOutputsParams(regex=BENCH_REGEX)
        # An edit's answer ends where the model ends it (max_tokens caps it): past its EOS a
        # model writes a new turn of anything, which measures nothing the workload is about.
        return SamplingParams(
            temperature=self.temperature, top_p=1.0, max_tokens=max_tokens,
            ignore_eos=self.prompt_kind != "edit",
            detokenize=self.detokenize, stop=HEAVY_STOP if heavy else None,
            logprobs=HEAVY_LOGPROBS if heavy else None, structured_outputs=so)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["output_len_range"] = list(self.output_len_range) if self.output_len_range else None
        return d


def parse_len_range(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"output_len_range must look like A:B, got {text!r}") from None
    return lo, hi


def workload_from_args(ns: argparse.Namespace, num_prompts: int | None = None,
                       host_work: str | None = None) -> Workload:
    return Workload(ns.input_len, ns.output_len, num_prompts or ns.num_prompts,
                    parse_len_range(ns.output_len_range), ns.seed,
                    host_work or ns.host_work, not ns.disable_detokenize, ns.temperature,
                    getattr(ns, "structured_output", "none"),
                    getattr(ns, "prompt_kind", "random"))


def workload_tokens(ns: argparse.Namespace, workload: Workload
                    ) -> tuple[list[list[int]], list[int]]:
    """The workload's prompts and output lengths without building an engine (the same ids
    ``workload.prompts(vocab_size_of(engine))`` gives)."""
    from cadence.engine import vocab_size_from_config
    from cadence.engine_args import EngineArgs
    from cadence.tokenizer_loader import load_tokenizer

    model = EngineArgs(model=ns.model).resolve_model()
    tokenizer = load_tokenizer(ns.tokenizer or model)
    vocab = prompt_vocab_size(vocab_size_from_config(model), tokenizer)
    return workload.prompts(vocab, tokenizer), workload.output_lens()


def vocab_size_of(engine: Any) -> int:
    return prompt_vocab_size(engine.vocab_size, engine.tokenizer)


def prompt_vocab_size(config_vocab_size: int | None, tokenizer: Any) -> int:
    """Random prompt ids stay below both the model's and the tokenizer's vocabulary."""
    sizes = [config_vocab_size]
    try:
        sizes.append(len(tokenizer))
    except TypeError:
        pass
    sizes = [s for s in sizes if s]
    if not sizes:
        raise ValueError("cannot tell the model's vocabulary size for random prompts")
    return min(sizes)
