"""``ExampleBackend``: torch on the CPU, the sync strategy, and its own attention.

Everything torch-related that is not about *this* backend (loading the Hugging Face weights,
owning the KV cache tensors, turning a ``ModelInput`` into tensors, sampling) is reused from
``cadence.model_runner.ModelRunner``, cadence's public helper for backend authors. What this
backend adds is the attention over the paged cache (``attention.py``) and the answers to the
contract's questions: can it run here (``probe``), how big is the cache, and when does
``post_sample`` run (here: after sampling, the inherited sync strategy).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from cadence.backend import Backend, ModelInput, ProbeResult, SamplerOutput, SamplingMetadata
from cadence.plugins import check_backend_options

if TYPE_CHECKING:
    from cadence.config import EngineConfig

DEFAULT_KV_CACHE_GB = 0.5


class ExampleBackend(Backend):
    """Pure-torch CPU backend with per-sequence SDPA attention (``--backend example``)."""

    name = "example"
    # prepare/run_model/sample below are ModelRunner's, which compute them.
    supports_prompt_logprobs = True
    supports_pooling = True
    supports_lora = True
    supports_speculative = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        check_backend_options(config.backend_options, self.name, ("kv_cache_gb",))
        self.runner: Any = None

    @classmethod
    def probe(cls) -> ProbeResult:
        # find_spec locates torch without importing it: probing must stay cheap.
        if importlib.util.find_spec("torch") is None:
            return ProbeResult(False, "torch is not installed")
        return ProbeResult(True, "torch on the CPU (per-sequence SDPA, sync strategy)")

    def load_model(self) -> None:
        from cadence.model_runner import ModelRunner

        self.runner = ModelRunner(self.config, "cpu")
        self.runner.load_model()

    def allocate_kv_cache(self) -> int:
        from cadence_example_backend.attention import PerSequenceAttention

        gb = float(self.config.backend_option("kv_cache_gb", DEFAULT_KV_CACHE_GB))
        # Honours LLM(num_kv_blocks=...) and refuses a cache too small for max_model_len.
        num_blocks = self.runner.num_blocks_for_bytes(int(gb * (1 << 30)))
        k_caches, v_caches = self.runner.allocate_kv_cache(num_blocks)
        scale = self.runner.kv_cache_spec().head_dim ** -0.5
        self.runner.attn = PerSequenceAttention(k_caches, v_caches, scale)
        return num_blocks

    def forward(self, model_input: ModelInput) -> Any:
        from cadence_example_backend.attention import build_metadata

        return self.runner.run_model(self.runner.prepare(model_input, build_metadata))

    def sample(self, logits: Any, sampling: SamplingMetadata) -> Any:
        return self.runner.sample(logits, sampling)

    def to_host(self, sampled: Any) -> SamplerOutput:
        return self.runner.to_host(sampled)

    # execute() is inherited: forward -> sample -> to_host -> post_sample, the reference
    # strategy. torch CPU ops are synchronous, so there is no device time to overlap with.

    def env_info(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__, "attention": "per-sequence SDPA"}
