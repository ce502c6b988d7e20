"""LoRA adapters (cadence/lora; vLLM's multi-LoRA): greedy tokens equal PEFT's on the same
adapters and logprobs agree within 1e-4 in fp32, adapters of every kind PEFT saves (some or
all projections, rank-stabilized scaling) and the base model share a batch, a row's output
does not depend on its batch, the strategy or async scheduling, at most ``max_loras``
adapters run per step, each adapter keeps its own prefix-cache blocks, adapters beyond
``max_cpu_loras`` are dropped and loaded again, tensor parallel slices them right, and bad
adapters are refused naming the problem, with nothing queued."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from engine_helpers import PlanSpy, make_llm
from transformers import AutoModelForCausalLM

from cadence import LoRARequest, SamplingParams
from cadence.lora.adapter import check_lora_architecture

PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 500 + 2 for i in range(11)]},
           {"prompt_token_ids": [(5 * i + 11) % 500 + 2 for i in range(5)]},
           {"prompt_token_ids": [(3 * i + 1) % 500 + 2 for i in range(18)]}]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(model: str, out: str, seed: int, targets: list[str], r: int, alpha: int,
                 rslora: bool = False) -> str:
    """A PEFT adapter with random A and B (PEFT zeroes B by default), big enough to change
    the tokens, saved as PEFT saves it."""
    # Imported here: peft imports triton, which the CUDA backend's CPU-mode tests need
    # imported under TRITON_INTERPRET=1 (they set it when their module loads).
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                           init_lora_weights=False, use_rslora=rslora))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft.save_pretrained(out)
    return out


def make_adapters(model: str, folder) -> list[LoRARequest]:
    return [LoRARequest("qvd", 1, save_adapter(model, str(folder / "qvd"), 1,
                                               ["q_proj", "v_proj", "down_proj"], 8, 16)),
            LoRARequest("all", 2, save_adapter(model, str(folder / "all"), 2, ALL, 4, 8,
                                               rslora=True))]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> list[LoRARequest]:
    return make_adapters(model, tmp_path_factory.mktemp("adapters"))


def peft_reference(model: str, lora: LoRARequest | None, prompt: list[int], steps: int
                   ) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers with PEFT's adapter."""
    from peft import PeftModel

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if lora is not None:
        m = PeftModel.from_pretrained(m, lora.lora_path)
    ids = list(prompt)
    lps = []
    with torch.no_grad():
        for _ in range(steps):
            logits = m(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return ids[len(prompt):], lps


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_outputs_match_peft(tiny_model_dir, tmp_path, kind) -> None:
    """Base and both adapters in one batch; each row equals PEFT's greedy run."""
    model = tiny_model_dir(kind)
    loras = [None, *make_adapters(model, tmp_path)]
    llm = make_llm(model, enable_lora=True, max_loras=2, dtype="float32")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        prompts = [PROMPTS[0], PROMPTS[2]] * 3
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[lr for lr in loras for _ in range(2)])
    finally:
        llm.shutdown()
    distinct = set()
    for i, out in enumerate(outs):
        c = out.outputs[0]
        tokens, lps = peft_reference(model, loras[i // 2],
                                     prompts[i]["prompt_token_ids"], 6)
        assert list(c.token_ids) == tokens, (kind, i)
        got = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, (kind, i)
        distinct.add(tuple(tokens))
    assert len(distinct) == 6  # the adapters change every output: the test sees them


@pytest.fixture(scope="module")
def solo(model, adapters):
    """Each (prompt, adapter) pair run alone on the sync engine, for exact comparison."""
    llm = make_llm(model, enable_lora=True, max_loras=2)
    try:
        return {(i, j): summarize(llm.generate([p], _params(), use_tqdm=False,
                                               lora_request=lr))[0][2:]
                for i, p in enumerate(PROMPTS) for j, lr in enumerate([None, *adapters])}
    finally:
        llm.shutdown()


def summarize(outs) -> list:
    """Per output: its id, then the tokens, text, finish and every logprob unrounded."""
    return [(o.request_id, 0, tuple(c.token_ids), c.text, c.finish_reason,
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs])
            for o in outs for c in o.outputs]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=5, max_tokens=7, logprobs=2, stop=["zz"])


def _mixed(llm, adapters):
    """Every prompt with every adapter (and none), in one batch."""
    pairs = [(i, j) for j in range(3) for i in range(3)]
    loras = [None, *adapters]
    outs = llm.generate([PROMPTS[i] for i, _ in pairs], _params(), use_tqdm=False,
                        lora_request=[loras[j] for _, j in pairs])
    return {pair: row[2:] for pair, row in zip(pairs, summarize(outs))}


@pytest.mark.parametrize("options", [
    {"backend_options": {"overlap": "thread"}},
    {"backend_options": {"overlap": "sync"}, "disable_async_output_proc": True},
    {"backend_options": {"overlap": "process"}, "async_scheduling": True},
], ids=["thread", "sync-async-off", "process-async-scheduling"])
def test_batch_and_strategy_change_nothing(model, adapters, solo, options) -> None:
    llm = make_llm(model, enable_lora=True, max_loras=2, **options)
    try:
        assert _mixed(llm, adapters) == solo
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_bf16_rows_do_not_depend_on_the_batch(model, adapters) -> None:
    """In bfloat16 too (the CPU backend's updates in the model's dtype), each request's
    tokens and logprobs are those it gets alone."""
    llm = make_llm(model, enable_lora=True, max_loras=2, dtype="bfloat16")
    try:
        alone = {(i, j): summarize(llm.generate([p], _params(), use_tqdm=False,
                                                lora_request=lr))[0][2:]
                 for i, p in enumerate(PROMPTS) for j, lr in enumerate([None, *adapters])}
        assert _mixed(llm, adapters) == alone
    finally:
        llm.shutdown()


def test_max_loras_bounds_each_step(model, adapters, solo) -> None:
    """With one adapter per step, the other waits and the base model's requests go
    ahead; the outputs are those of the roomier engine."""
    llm = make_llm(model, enable_lora=True, max_loras=1)
    seen = []
    build = llm.engine._build_input

    gauges = []

    def spy(plan):
        mi = build(plan)
        seen.append({i for i in mi.lora_ids if i})
        stats = llm.engine.stats  # as the previous step left them (lora_requests_info)
        gauges.append((stats.max_loras, stats.running_loras, stats.waiting_loras))
        return mi

    llm.engine._build_input = spy
    spy_plans = PlanSpy(llm)
    try:
        assert _mixed(llm, adapters) == solo
    finally:
        llm.shutdown()
    assert max(map(len, seen)) == 1 and {1, 2} <= set().union(*seen)
    assert (1, ("qvd",), ("all",)) in gauges
    # The base model's requests were not held back behind the second adapter.
    first_step = {rid for rid, _, _ in spy_plans.steps[0]}
    assert len(first_step) == 6


def test_a_turned_away_adapter_is_not_overtaken_by_a_running_one(model, adapters) -> None:
    """With one adapter per step, a request for another adapter waits for the running one
    to drain, and later requests for the running adapter wait behind it instead of keeping
    it running for ever; the base model's requests are never held back."""
    llm = make_llm(model, enable_lora=True, max_loras=1)
    spy = PlanSpy(llm)
    eng = llm.engine
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    try:
        eng.add_request("a1", PROMPTS[0], long, lora_request=adapters[0])
        eng.step()
        eng.add_request("b1", PROMPTS[1], long, lora_request=adapters[1])
        eng.add_request("a2", PROMPTS[2], long, lora_request=adapters[0])
        eng.add_request("base", PROMPTS[1], long)
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        llm.shutdown()
    first = {rid: next(i for i, step in enumerate(spy.steps) if any(r == rid for r, _, _ in step))
             for rid in ("a1", "b1", "a2", "base")}
    assert first["a1"] < first["base"] < first["b1"] < first["a2"], first


def test_an_id_given_to_another_folder_gets_its_own_cache(model, adapters) -> None:
    """vLLM's remove_lora then add_lora of another folder under the same id: its prompts
    never hit blocks computed under the old folder."""
    llm = make_llm(model, enable_lora=True, max_loras=1)
    eng = llm.engine
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0.0, max_tokens=3)
    try:
        (old,) = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters[0])
        assert eng.remove_lora(1) and eng.list_loras() == []
        other = LoRARequest("other", 1, adapters[1].lora_path)
        assert eng.add_lora(other) and [lr.lora_name for lr in eng.list_loras()] == ["other"]
        (new,) = llm.generate([prompt], params, use_tqdm=False, lora_request=other)
        (alone,) = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters[1])
    finally:
        llm.shutdown()
    assert new.num_cached_tokens == 0 and alone.num_cached_tokens == 0
    assert new.outputs[0].token_ids == alone.outputs[0].token_ids != old.outputs[0].token_ids


def test_prefix_cache_is_per_adapter(model, adapters) -> None:
    """The same prompt under another adapter computes its own K/V; under the same one it
    hits the cache."""
    llm = make_llm(model, enable_lora=True, max_loras=2)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0.0, max_tokens=3)
    try:
        runs = [llm.generate([prompt], params, use_tqdm=False, lora_request=lr)[0]
                for lr in (adapters[0], adapters[1], None, adapters[0])]
    finally:
        llm.shutdown()
    assert [r.num_cached_tokens for r in runs] == [0, 0, 0, 32]
    assert runs[3].outputs[0].token_ids == runs[0].outputs[0].token_ids
    assert len({tuple(r.outputs[0].token_ids) for r in runs[:3]}) == 3


def test_adapters_beyond_max_cpu_loras_are_loaded_again(model, adapters, solo) -> None:
    llm = make_llm(model, enable_lora=True, max_loras=1, max_cpu_loras=1)
    try:
        for j in (1, 2, 1, 2):
            out = llm.generate([PROMPTS[0]], _params(), use_tqdm=False,
                               lora_request=adapters[j - 1])
            assert summarize(out)[0][2:] == solo[(0, j)]
            assert llm.engine.backend.runner.lora.num_loaded == 1
    finally:
        llm.shutdown()


@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_ranks_apply_the_adapters(model, adapters, solo, split) -> None:
    """Two tensor-parallel ranks (q/k/v and gate/up split by rows, o and down by columns
    with the shrink summed over the ranks), or two pipeline stages (each its layers'
    updates), give one process's tokens and logprobs."""
    _check_two_ranks(model, adapters, solo, split)


def test_tensor_parallel_with_replicated_kv_heads(tiny_model_dir, tmp_path) -> None:
    """One KV head on two ranks: each rank holds it whole, and the adapter's k/v rows too."""
    model = tiny_model_dir("llama-mqa")
    adapters = make_adapters(model, tmp_path)
    llm = make_llm(model, enable_lora=True, max_loras=2)
    try:
        solo = _mixed(llm, adapters)
    finally:
        llm.shutdown()
    _check_two_ranks(model, adapters, solo, "tensor_parallel_size")


def _check_two_ranks(model, adapters, solo, split) -> None:
    llm = make_llm(model, enable_lora=True, max_loras=2, num_kv_blocks=64, **{split: 2})
    try:
        got = _mixed(llm, adapters)
    finally:
        llm.shutdown()
    for pair, want in solo.items():
        assert got[pair][0] == want[0], pair  # the tokens
        for a, b in zip(got[pair][-1], want[-1]):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert max(abs(x[1] - y[1]) for x, y in zip(a, b)) < 1e-4


def _edit_config(folder, **changes) -> str:
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(folder)


def _written(folder, good: str, name: str, content: bytes | None) -> str:
    """A copy of the adapter ``good`` with file ``name`` replaced by ``content`` (None: its
    first half)."""
    shutil.copytree(good, folder)
    path = os.path.join(folder, name)
    if content is None:
        with open(path, "rb") as f:
            content = f.read()
        content = content[:len(content) // 2]
    with open(path, "wb") as f:
        f.write(content)
    return str(folder)


def test_bad_adapters_are_refused(model, adapters, tmp_path, tiny_model_dir) -> None:
    good = adapters[0].lora_path

    def variant(name, **changes):
        shutil.copytree(good, tmp_path / name)
        return _edit_config(tmp_path / name, **changes)

    other = save_adapter(tiny_model_dir("qwen3"), str(tmp_path / "qwen3"), 3, ["q_proj"], 4, 8)
    cases = [
        (LoRARequest("x", 9, str(tmp_path / "missing")), "does not exist"),
        (LoRARequest("x", 9, str(tmp_path)), "no adapter_config.json"),
        (LoRARequest("x", 9, variant("dora", use_dora=True)), "DoRA"),
        (LoRARequest("x", 9, variant("saved", modules_to_save=["lm_head"])), "modules_to_save"),
        (LoRARequest("x", 9, variant("bias", bias="all")), "bias"),
        (LoRARequest("x", 9, variant("prefix", peft_type="PREFIX_TUNING")), "peft_type"),
        (LoRARequest("x", 9, other), "another model"),
        (LoRARequest("other-path", 1, adapters[1].lora_path), "one id names one folder"),
        (LoRARequest("x", 9, variant("array", rank_pattern={"(": 3})),
         "not a regular expression"),
        (LoRARequest("x", 9, variant("zero", rank_pattern={"q_proj": 0})),
         "rank_pattern must map module names to positive numbers"),
        (LoRARequest("x", 9, variant("alpha", alpha_pattern={"q_proj": "x"})),
         "alpha_pattern must map"),
        (LoRARequest("x", 9, _written(tmp_path / "list", good, "adapter_config.json", b"[]")),
         "must hold a JSON object"),
        # Cut short: refused when it is checked, not met by the step that reads it.
        (LoRARequest("x", 9, _written(tmp_path / "cut", good, "adapter_model.safetensors",
                                      None)), "is damaged"),
        ("qvd", "must be a LoRARequest"),
    ]
    llm = make_llm(model, enable_lora=True, max_lora_rank=4)
    try:
        eng = llm.engine
        with pytest.raises(ValueError, match="above --max-lora-rank 4"):
            eng.add_request("r", PROMPTS[0], _params(), lora_request=adapters[0])
        small = make_llm(model, enable_lora=True)
        try:
            small.engine.add_request("ok", PROMPTS[0], _params(), lora_request=adapters[0])
            for lora, message in cases:
                with pytest.raises(ValueError, match=message):
                    small.engine.add_request("bad", PROMPTS[0], _params(), lora_request=lora)
            out = small._run_until_done(["ok"])
            assert out[0].outputs[0].token_ids
            assert small.engine.block_manager.num_free_blocks == small.engine.num_blocks
        finally:
            small.shutdown()
        assert not eng.has_unfinished_requests()
    finally:
        llm.shutdown()
    plain = make_llm(model)
    try:
        with pytest.raises(ValueError, match="without LoRA"):
            plain.generate([PROMPTS[0]], _params(), use_tqdm=False, lora_request=adapters[0])
        with pytest.raises(ValueError, match="one entry per prompt"):
            plain.generate([PROMPTS[0]], _params(), use_tqdm=False,
                           lora_request=[adapters[0]] * 2)
    finally:
        plain.shutdown()


def test_lora_is_refused_where_it_cannot_run(model, tmp_path, monkeypatch) -> None:
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LoRA adapters are supported for LlamaForCausalLM"):
        check_lora_architecture(str(folder))
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")  # the HPU backend declares no LoRA
    with pytest.raises(ValueError, match="not supported by backend 'hpu'.*cpu"):
        make_llm(model, backend="hpu", enable_lora=True)
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        make_llm(model, enable_lora=True, max_loras=2, max_cpu_loras=1)


@pytest.mark.parametrize("kind", ["tiled", "amx"])
def test_update_gemms_do_not_read_other_rows(ops, kind) -> None:
    """The CPU backend's GEMMs for the updates (a shrink to rank 8, an expand from it) give
    a row the same bits whatever the batch: torch's GEMM does not on some CPUs (rows of a
    batch of up to 8 differ from the same rows in a batch of 256 on an AMX Xeon)."""
    from cadence.backends.cpu.linear import amx_ops, row_independent_gemm

    if kind == "amx" and amx_ops() is None:
        pytest.skip("this CPU has no AMX bf16 tiles (the tiled kind covers fp32)")
    dtype = torch.float32 if kind == "tiled" else torch.bfloat16
    make = row_independent_gemm(kind)
    gen = torch.Generator().manual_seed(0)
    shrink = make(torch.randn(8, 576, generator=gen).to(dtype))
    expand = make(torch.randn(1536, 8, generator=gen).to(dtype))
    x = torch.randn(256, 576, generator=gen).to(dtype)
    want = expand(shrink(x))
    for m in (1, 2, 3, 5, 8, 13, 64):
        assert torch.equal(expand(shrink(x[:m])), want[:m]), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_add_kernel(ops, dtype) -> None:
    """csrc/lora.cpp: each row adds its own columns' update in place, close to torch's
    product, the same bits whatever the other rows and columns hold; rows with no columns
    are left alone."""
    gen = torch.Generator().manual_seed(0)
    m, n, c = 37, 1000, 48  # n not a multiple of the vector blocks: the tail columns too
    t = torch.randn(m, c, generator=gen).to(dtype)
    bt = torch.randn(c, n, generator=gen).to(dtype).float()  # weights of the model's dtype
    y0 = torch.randn(m, n, generator=gen).to(dtype)
    # Runs of rows with one adapter (grouped by the kernel) and rows that change adapter.
    first = torch.tensor([((r // 6) % 3) * 16 if r < 24 else (r % 3) * 16 for r in range(m)])
    count = torch.tensor([0 if r % 7 == 0 else 16 - (first[r] // 16).item()
                          for r in range(m)])
    y = y0.clone()
    ops.lora_expand_add(y, t, bt, first, count, torch.arange(m))
    for r in range(m):
        f, k = int(first[r]), int(count[r])
        want = y0[r].float() + t[r, f:f + k].float() @ bt[f:f + k].float()
        tol = 1e-4 if dtype == torch.float32 else 0.1
        assert torch.allclose(y[r].float(), want, atol=tol, rtol=tol / 10), r
        if k == 0:
            assert torch.equal(y[r], y0[r])
    # Other rows and the other adapters' columns change nothing in a row: row 9 ran in a
    # block of four rows of one adapter (rows 8-11), here beside rows of other adapters.
    assert len({(int(first[r]), int(count[r])) for r in range(8, 12)}) == 1
    noise = torch.randn(5, c, generator=gen).to(dtype)
    rows = [9, 0, 1, 2, 30, 31]
    y2 = torch.cat([y0[9:10], torch.randn(5, n, generator=gen).to(dtype)])
    ops.lora_expand_add(y2, torch.cat([t[9:10], noise]), bt, first[rows], count[rows],
                        torch.tensor([3, 1, 0, 5, 2, 4]))
    assert torch.equal(y2[0], y[9])
