"""LoRA adapters: many fine-tunes of one model served side by side (vLLM's multi-LoRA).

The data flow (docs/architecture.md, "LoRA adapters"):
- engine side, no torch: ``LoRARequest`` names an adapter folder; ``registry`` checks it
  against the model the first time its id is seen (``adapter``); ``admission`` keeps at most
  ``max_loras`` adapters in the running batch; the block manager keeps each adapter's
  prefix-cache blocks apart (``Request.cache_namespace``); the input builder puts each
  sequence's adapter id and the adapters' folders in the ``ModelInput``.
- model side, where the weights live (any rank, stage or worker process): ``runtime``
  wraps the projections at load (``layers``), loads adapters as steps ask for them
  (``weights``), and hands the forward pass a ``LoRAStep`` through the forward context.
"""

from cadence.lora.config import LoRAConfig
from cadence.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
