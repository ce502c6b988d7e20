"""Weights and KV cache on transparent huge pages (core/host_memory.py,
backends/cpu/memory.py): the choice, the move of a model's tensors into one mapping, the
KV cache's prefault, and an engine that gives the same bits with and without them."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_with_logprobs, make_llm
from test_engine_parity import NUM_TOKENS, _prompts, hf_greedy
from torch import nn

from cadence import host_memory
from cadence.backends.cpu import memory
from cadence.model_runner import lazy_zeros


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"),
                                       ("[always] madvise never\n", "always"),
                                       ("always madvise [never]\n", "never"),
                                       ("garbage\n", None)])
def test_thp_mode_reads_the_bracketed_setting(tmp_path, text, mode) -> None:
    f = tmp_path / "enabled"
    f.write_text(text)
    assert host_memory.thp_mode(f) == mode
    assert host_memory.thp_mode(tmp_path / "missing") is None


def test_resolve_names_the_choices_and_refuses_without_thp(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"one of \('off', 'weights', 'all'\).*'yes'"):
        memory.resolve_huge_pages("yes")
    monkeypatch.setattr(memory, "huge_pages_available", lambda: False)
    monkeypatch.setattr(memory, "thp_mode", lambda: "never")
    assert memory.resolve_huge_pages("off") == "off"
    for choice in ("weights", "all"):
        with pytest.raises(ValueError, match="'never'.*--cpu-huge-pages off"):
            memory.resolve_huge_pages(choice)
    monkeypatch.setattr(memory, "huge_pages_available", lambda: True)
    assert [memory.resolve_huge_pages(c) for c in ("off", "weights", "all")] == \
        ["off", "weights", "all"]


@pytest.mark.parametrize("huge", [False, True])
def test_anonymous_buffer_is_private_zeroed_and_marked(huge) -> None:
    buf = host_memory.anonymous_buffer(8 << 20, huge)
    assert buf.dtype == torch.uint8 and buf.numel() == 8 << 20
    assert int(buf.count_nonzero()) == 0
    buf[5] = 7
    entry = _smaps_entry(buf.data_ptr())
    # Private (not shared memory, which THP's anonymous setting does not cover).
    assert entry["Anonymous"] != "0 kB", entry
    flags = entry["VmFlags"].split()
    # Marked where the kernel has THP at all (its sysfs folder), whatever the setting.
    marked = huge and hasattr(mmap, "MADV_HUGEPAGE") and host_memory.thp_mode() is not None
    assert ("hg" in flags) == marked, flags


def test_lazy_zeros_gives_separate_zeroed_tensors() -> None:
    a, b = lazy_zeros((64, 3, 8), torch.bfloat16, 2, huge_pages=True)
    a.fill_(1.5)
    assert int(b.count_nonzero()) == 0 and bool((a == 1.5).all())
    assert a.shape == (64, 3, 8) and a.dtype == torch.bfloat16


class _Holder(nn.Module):
    """Parameters, a tied one, a buffer, a view and a plain tensor attribute (the kind of
    thing ``pack_linears`` leaves: ``.packed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(300, 200)
        self.b = nn.Linear(200, 300, bias=False)
        self.b.weight = nn.Parameter(self.a.weight.t())  # tied through a view
        self.register_buffer("table", torch.arange(1000.0))
        self.packed = torch.randn(123, 45)
        self.head = self.packed[:3]

    def forward(self, x):
        return self.b(self.a(x)) + self.table[:300] + self.packed.sum()


def test_move_keeps_every_tensor_its_values_ties_and_identity() -> None:
    m = _Holder()
    x = torch.randn(4, 300)
    expected = m(x)
    before = {name: t.clone() for name, t in [("a", m.a.weight), ("p", m.packed)]}
    weight, packed = m.a.weight, m.packed
    moved = memory.move_weights_to_huge_pages(m)
    assert moved > 0 and moved % 4096 == 0
    assert torch.equal(m(x), expected)
    assert m.a.weight is weight and m.packed is packed  # the same objects, rebound
    assert torch.equal(m.a.weight, before["a"]) and torch.equal(m.packed, before["p"])
    # One mapping holds them all; the tie and the view still share their storage.
    ptrs = {t.untyped_storage().data_ptr() for t in
            (m.a.weight, m.a.bias, m.b.weight, m.table, m.packed, m.head)}
    assert len(ptrs) == 1
    assert m.b.weight.data_ptr() == m.a.weight.data_ptr()
    assert m.head.data_ptr() == m.packed.data_ptr() and torch.equal(m.head, m.packed[:3])
    assert m.a.weight.requires_grad
    for t in (m.a.weight, m.packed, m.table):
        assert t.data_ptr() % 64 == 0
    assert memory.move_weights_to_huge_pages(nn.Module()) == 0


def test_move_reaches_tensors_held_in_a_list() -> None:
    # A quantized linear keeps its packed parts in a list (backends/cpu/quantized.py).
    m = nn.Module()
    parts = [torch.randn(5, 7), torch.arange(9, dtype=torch.uint8)]
    m.packed = parts
    before = [p.clone() for p in parts]
    assert memory.move_weights_to_huge_pages(m) > 0
    assert m.packed is parts and all(torch.equal(p, b) for p, b in zip(parts, before))
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1


def test_prefault_touches_from_the_first_block_up_within_its_time() -> None:
    caches = lazy_zeros((8 << 20,), torch.uint8, 3, huge_pages=True)
    step = 2 << 20
    assert memory.prefault_kv_cache(caches, seconds=0.0) == 3 * step  # one round, always
    assert memory.prefault_kv_cache(caches, seconds=60.0) == 3 * (8 << 20)
    assert all(int(c.count_nonzero()) == 0 for c in caches)  # touched, not changed
    assert memory.prefault_kv_cache([], seconds=1.0) == 0


def _greedy(model: str, huge: str, prompts: list[list[int]]):
    """tokens, logprobs, runtime info, (parameter storages, whether the KV cache is marked)."""
    def placement(llm):
        runner = llm.engine.backend.runner
        storages = {p.untyped_storage().data_ptr() for p in runner.model.parameters()}
        kv = _smaps_entry(runner.attn.k_caches[0].data_ptr())["VmFlags"].split()
        return len(storages), "hg" in kv
    return greedy_with_logprobs(model, prompts, NUM_TOKENS, placement,
                                backend_options={"overlap": "sync", "kv_cache_gb": 0.02,
                                                 "huge_pages": huge})


def test_engine_gives_the_same_bits_on_every_choice(tiny_model_dir, monkeypatch) -> None:
    model = tiny_model_dir("llama")
    prompts = _prompts()
    monkeypatch.setattr(memory, "huge_pages_available", lambda: True)
    runs = {c: _greedy(model, c, prompts) for c in ("off", "weights", "all")}
    for choice, (_, _, info, _) in runs.items():
        assert info["cpu_huge_pages"] == choice
    storages = {c: runs[c][3][0] for c in runs}
    assert storages["off"] > 1 and storages["weights"] == storages["all"] == 1  # one mapping
    marked = host_memory.thp_mode() is not None  # the kernel has THP at all
    assert [runs[c][3][1] for c in ("off", "weights", "all")] == [False, False, marked]
    assert runs["off"][:2] == runs["weights"][:2] == runs["all"][:2]  # tokens, logprobs
    assert runs["off"][0] == hf_greedy(model, prompts, NUM_TOKENS)


def test_engine_refuses_a_bad_choice(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="cpu huge pages must be one of"):
        make_llm(tiny_model_dir("llama"), backend_options={"overlap": "sync",
                                                           "huge_pages": "maybe"})
