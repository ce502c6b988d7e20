"""Helpers for engine-level tests: run an LLM and reduce outputs to comparable tuples,
and spy on the plans the scheduler produces."""

from __future__ import annotations

from cadence import LLM, SamplingParams


def summarize(outputs) -> list:
    """Everything observable about a generate() result, for exact comparisons."""
    rows = []
    for o in outputs:
        for c in o.outputs:
            lps = None
            if c.logprobs is not None:
                lps = [sorted((t, round(lp.logprob, 5), lp.rank) for t, lp in d.items())
                       for d in c.logprobs]
            rows.append((o.request_id, c.index, tuple(c.token_ids), c.text, c.finish_reason,
                         c.stop_reason, lps))
    return rows


class PlanSpy:
    """Records every StepPlan of an engine: (request_id, num_computed, num_new) per entry."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []
        sched = llm.engine.scheduler
        original = sched.schedule

        def schedule():
            plan = original()
            self.steps.append([(s.request.request_id, s.request.num_computed_tokens,
                                s.num_new_tokens) for s in plan.scheduled])
            return plan

        sched.schedule = schedule

    def times_scheduled(self, request_id: str) -> int:
        return sum(1 for step in self.steps for rid, _, _ in step if rid == request_id)

    def saw_chunked_prefill(self, prompt_lens: dict[str, int]) -> bool:
        return any(0 < new < prompt_lens[rid] - computed and computed < prompt_lens[rid]
                   for step in self.steps for rid, computed, new in step if rid in prompt_lens)


def make_llm(model: str, **kw) -> LLM:
    """An LLM for tests. The CPU backend runs the ``sync`` strategy unless told otherwise:
    the ``process`` default costs seconds of start-up per engine, and tests that are about
    the strategies ask for them by name."""
    kw.setdefault("max_model_len", 256)
    if kw.get("backend", "cpu") == "cpu":
        kw.setdefault("backend_options", {"overlap": "sync"})
    return LLM(model=model, backend=kw.pop("backend", "cpu"), **kw)


def generate(llm: LLM, prompts, params: SamplingParams | list[SamplingParams]):
    return llm.generate(prompts, params, use_tqdm=False)


def greedy_pair(model: str, prompt: list[int], num_tokens: int, **llm_kw
                ) -> tuple[list[int], list[int]]:
    """(cadence's, transformers' cached ``generate``) greedy tokens for one prompt, exactly
    ``num_tokens`` each (EOS ignored), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                       min_new_tokens=num_tokens, do_sample=False)[0, len(prompt):].tolist()
    llm = make_llm(model, **llm_kw)
    got = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    return list(got), want
