"""What every model family shares: the attributes the engine reads, building on the meta
device, the LM head (tied to the embeddings or its own), fp32 logits, and checkpoint loading
with fused projections filled shard by shard.

A family subclasses ``CausalLM``, builds its layers with ``build``, and says how its
checkpoint names map onto its parameters (``fused_parts``, ``convert_weight``); the loader
then checks that every parameter was loaded exactly from the checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from cadence.distributed import all_gather, pp_layer_range, pp_rank, pp_size, tp_size
from cadence.layers.linear import ColumnParallelLinear
from cadence.layers.logits import RefineTopLogits
from cadence.model_limits import layer_windows
from cadence.models import is_base_model


def sliding_windows(config: Any, max_model_len: int | None) -> list[int | None]:
    """Each layer's sliding window (None: full attention), read from the config as
    transformers reads it (``cadence.model_limits.layer_windows``). A window at least
    ``max_model_len`` long never cuts a key, so it is dropped (full attention, the same
    output) and the backend's full path runs."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    windows = layer_windows(cfg)
    if len(windows) != config.num_hidden_layers:
        raise ValueError(f"layer_types names {len(windows)} layers, the model has "
                         f"{config.num_hidden_layers} (num_hidden_layers)")
    longest = max_model_len or config.max_position_embeddings
    return [None if w is not None and w >= longest else w for w in windows]


class NotOnThisStage(nn.Module):
    """Stands where a module of another pipeline stage would be (vLLM's ``PPMissingLayer``):
    it holds no weights, so the checkpoint's are skipped, and running it is a bug."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module belongs to another pipeline stage")


def empty_embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialized (``load_weights`` fills it)."""
    # _weight skips the random init: on the meta device normal_ runs through torch's Python
    # reference ops, whose first use imports torch._dynamo (~1-2 s of start-up).
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class CausalLM(nn.Module):
    """Base of the decoder families.

    The engine reads ``num_layers``, ``num_kv_heads``, ``head_dim`` (the KV cache's shape),
    ``vocab_size`` and ``hidden_size``, calls ``forward(input_ids, positions)`` -> hidden
    states [T, hidden] and ``compute_logits(hidden)`` -> fp32 logits, and ``load_weights``.

    Under pipeline parallel (docs/distributed.md) the model holds its stage's decoder
    layers only (``layer_range``; ``num_layers`` counts them, so the KV cache holds them
    only), the embeddings on the first stage and the final norm and LM head on the last;
    ``forward`` on a stage before the last hands its activations on and returns None.

    Class data a family sets (read-only):
    - ``fused_parts``: checkpoint projection name -> (our fused module, shard index), for
      projections the model runs as one GEMM (q/k/v, gate/up); ``fused_sizes`` gives each
      fused module's shard rows.
    """

    fused_parts: ClassVar[dict[str, tuple[str, int]]] = {}

    def __init__(self, config: Any, dtype: torch.dtype, head_dim: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        # Pipeline parallel: this stage's decoder layers (all of them on one stage).
        self.is_first_stage = pp_rank() == 0
        self.is_last_stage = pp_rank() == pp_size() - 1
        self.layer_range = pp_layer_range(config.num_hidden_layers) if pp_size() > 1 \
            else range(config.num_hidden_layers)
        self.num_layers = len(self.layer_range)
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) \
            or self.total_num_heads
        self.head_dim = head_dim or getattr(config, "head_dim", None) \
            or config.hidden_size // self.total_num_heads
        # Under tensor parallel (docs/distributed.md) this rank's heads, and so its KV cache:
        # the query heads split evenly, the KV heads too or one each when fewer than ranks.
        self.tp_size = tp_size()
        self.num_heads = self.total_num_heads // self.tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // self.tp_size)
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.refine_logits = RefineTopLogits()

    # -- building ---------------------------------------------------------------------------

    def build(self, prefix: str, body: Callable[[], nn.Module], embed: str,
              head_bias: bool = False) -> None:
        """Build ``body()`` as ``self.<prefix>`` (HF's name for it, so checkpoint names map
        directly) and the LM head, on the meta device first (no time spent on random init of
        weights that ``load_weights`` overwrites), then materialize them uninitialized in the
        model's dtype. A tied head shares ``self.<prefix>.<embed>``'s weight."""
        self._body, self._embed = prefix, embed
        with torch.device("meta"):
            module = body()
            # Vocabulary-parallel under tensor parallel: each rank computes its rows' logits.
            lm_head = ColumnParallelLinear(self.hidden_size, self.vocab_size, bias=head_bias) \
                if self.is_last_stage else NotOnThisStage()
        setattr(self, prefix, module.to(self.dtype).to_empty(device="cpu"))
        self.lm_head = lm_head.to(self.dtype).to_empty(device="cpu")
        if self.tie_word_embeddings and self.is_first_stage and self.is_last_stage:
            self.lm_head.weight = module.get_submodule(embed).weight

    # -- logits -----------------------------------------------------------------------------

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32, the entries tied at a
        row's maximum exact in fp32 when the head runs in bf16 (core/layers/logits.py), then
        the family's own final step (``finish_logits``)."""
        head = self.lm_head
        logits = self.refine_logits(head(hidden), hidden, getattr(head, "weight", None),
                                    head.bias)
        if self.tp_size > 1:
            # Each rank refined its own shard's maxima (the row's maximum is one of them, so
            # greedy picks what one process picks); padding rows past the vocabulary go.
            logits = all_gather(logits, dim=-1)[:, :self.vocab_size]
        return self.finish_logits(logits)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits -> the family's logits (a scale, a soft cap); monotonic per row, so
        the exact maxima stay the maxima. Identity by default."""
        return logits

    # -- loading ----------------------------------------------------------------------------

    def convert_weight(self, name: str, tensor: torch.Tensor
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """One checkpoint tensor -> (our name, tensor) pairs; none to skip it. The default
        skips stored rotary frequencies (recomputed) and renames nothing."""
        if "rotary_emb.inv_freq" not in name:
            yield name, tensor

    @property
    def takes_tensors_as_they_are(self) -> bool:
        """Whether ``convert_weight`` is the default (renames nothing, reorders and joins
        nothing): only then may a loader hand a weight's shape for its data
        (``load_weights``' ``shape_only``)."""
        return type(self).convert_weight is CausalLM.convert_weight

    def fused_sizes(self, fused: str) -> list[int]:
        """Rows of each shard of the fused module ``fused`` (see ``fused_parts``)."""
        if fused == "qkv_proj":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return [q, kv, kv]
        if fused == "gate_up_proj":
            size = self.config.intermediate_size // self.tp_size
            return [size, size]
        raise NotImplementedError(f"{type(self).__name__} names no shard sizes for {fused}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     optional: Container[str] = (), shape_only: Container[str] = (),
                     partial: bool = False) -> set[str]:
        """Copy HF-named checkpoint tensors in, filling fused parameters shard by shard, and
        refuse a checkpoint with an unknown, misshapen or missing weight. Names in
        ``optional`` (read once ``weights`` is exhausted) may be unknown: they are
        skipped. A tensor named in ``shape_only`` (read as it arrives) carries only its
        shape: checked and counted as loaded, never copied, so its weight's memory is not
        touched; whoever passes it fills that weight (a packed checkpoint's linears,
        ``cadence.quantization.packed``), and only where ``convert_weight`` is the default
        (one that reorders or joins tensors would be handed no data). ``partial``: some
        weights only, none missing. Returns the checkpoint names settled: written, or not
        this model's to hold (another stage's, a head tied to the embeddings)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        owned = dict(self.named_parameters())  # a tied head's weight counts once
        shared = set(params) - set(owned)
        fused_re = fused_pattern(self.fused_parts)
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        written: set[str] = set()
        unexpected: list[str] = []
        for ckpt_name, ckpt_tensor in weights:
            for converted, tensor in self.convert_weight(self.body_weight_name(ckpt_name),
                                                         ckpt_tensor):
                name = self.stage_weight_name(converted)
                if name is None:
                    written.add(ckpt_name)
                    continue  # another pipeline stage's weight
                if name in shared:
                    written.add(ckpt_name)
                    continue  # the head tied to the embeddings: loaded under their name
                target, shard = name, None
                match = fused_re.match(name) if fused_re is not None else None
                if match is not None:
                    prefix, proj, kind = match.groups()
                    fused, shard = self.fused_parts[proj]
                    target = f"{prefix}.{fused}.{kind}"
                if target not in params:
                    unexpected.append(ckpt_name)
                    continue
                dest = params[target].data
                module_name, _, kind = target.rpartition(".")
                tp_load = getattr(modules.get(module_name), "tp_load", None)
                if tp_load is not None:  # this rank's slice (tensor parallel)
                    tensor = tp_load(kind, shard, tensor)
                if shard is not None:
                    sizes = self.fused_sizes(target.split(".")[-2])
                    start = sum(sizes[:shard])
                    dest = dest[start:start + sizes[shard]]
                if dest.shape != tensor.shape:
                    raise ValueError(f"checkpoint weight {ckpt_name} has shape "
                                     f"{tuple(tensor.shape)}, the model expects "
                                     f"{tuple(dest.shape)}")
                if ckpt_name not in shape_only:
                    dest.copy_(tensor)
                    written.add(ckpt_name)
                loaded.add(target if shard is None else f"{target}#{shard}")
        unexpected = [n for n in unexpected if n not in optional]
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:5]}")
        missing = [] if partial else [n for n in owned if not self._is_loaded(n, loaded)]
        if missing == ["lm_head.weight"] and is_base_model(
                getattr(self.config, "architectures", None)):
            missing = self._stand_in_head()
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}")
        return written

    def body_weight_name(self, name: str) -> str:
        """Checkpoint name -> the HF name under the model's body: a base model saved alone
        (an embedding model's checkpoint) names its weights without the body's prefix,
        ``layers.0...`` for ``model.layers.0...``."""
        body = getattr(self, "_body", None)
        if body and name.startswith(("layers.", f"{self._embed}.", f"{self.final_norm}.")):
            return f"{body}.{name}"
        return name

    def _stand_in_head(self) -> list[str]:
        """A base model has no LM head: the embeddings' weight stands in, so the forward's
        shapes hold (the engine samples one token it drops for each embedding request and
        refuses generation: ``ModelConfig.has_lm_head``). Returns what is still missing."""
        if not self.is_first_stage:
            raise ValueError("this checkpoint is a base model without an LM head, and under "
                             "pipeline parallel its last stage holds no embeddings to stand "
                             "in for one: serve it without --pipeline-parallel-size")
        self.lm_head.weight = self.get_submodule(f"{self._body}.{self._embed}").weight
        return []

    #: The final norm's name inside the body (HF's): the last pipeline stage holds it.
    final_norm: ClassVar[str] = "norm"

    def stage_weight_name(self, name: str) -> str | None:
        """Our name for checkpoint weight ``name`` on this pipeline stage, None when
        another stage holds it: decoder layers outside ``layer_range``, the embeddings past
        the first stage, the final norm and the LM head before the last. A last stage that
        has no embeddings loads a tied head from the embeddings' weight."""
        if pp_size() == 1:
            return name
        body = self._body
        if name.startswith(f"{body}.layers."):
            index = int(name.split(".", 3)[2])
            return name if index in self.layer_range else None
        if name.startswith(f"{body}.{self._embed}."):
            if self.is_first_stage:
                return name
            if self.is_last_stage and self.tie_word_embeddings:
                return "lm_head." + name.rsplit(".", 1)[1]
            return None
        if name.startswith((f"{body}.{self.final_norm}.", "lm_head.")):
            return name if self.is_last_stage else None
        return name

    def _is_loaded(self, name: str, loaded: set[str]) -> bool:
        if name in loaded:
            return True
        module = name.split(".")[-2] if "." in name else ""
        if module not in {fused for fused, _ in self.fused_parts.values()}:
            return False
        return all(f"{name}#{i}" in loaded for i in range(len(self.fused_sizes(module))))


def fused_pattern(parts: dict[str, tuple[str, int]]) -> re.Pattern[str] | None:
    if not parts:
        return None
    names = "|".join(map(re.escape, parts))
    return re.compile(rf"^(.*)\.({names})\.(weight|bias)$")
