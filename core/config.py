"""Engine configuration. Dataclasses validated in __post_init__; CLI flags follow the fields.

"auto" values (dtype, max_model_len) are resolved by ``EngineArgs.create_engine_config``
before these are built, never patched afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cadence.distributed import EXPERT_PLACEMENTS
from cadence.lora.config import LoRAConfig
from cadence.pooling.config import PoolerConfig
from cadence.quantization import check_quantization
from cadence.spec_decode.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority")
DEFAULT_STEP_TIMEOUT_S = 600.0
DEFAULT_STARTUP_TIMEOUT_S = 1200.0
DEFAULT_MAX_WORKER_RESTARTS = 3
# The sampling fields a model's generation_config.json may default (vLLM's list, under
# SamplingParams' names; docs/semantics.md).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    tokenizer: str | None = None
    # (field, value) pairs from generation_config.json, resolved by EngineArgs; they fill
    # the sampling fields a request leaves out (core/generation_defaults.py).
    generation_defaults: tuple[tuple[str, object], ...] = ()
    # How embedding requests pool (cadence/pooling), resolved by EngineArgs from the model
    # folder and the command line.
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    # False for a base model saved without its LM head (an embedding model): it serves
    # embeddings only, and generation requests are refused.
    has_lm_head: bool = True
    # How the weights are kept in memory (cadence/quantization); None: the checkpoint's dtype.
    quantization: str | None = None
    # The EOS ids generation stops on, from the generation config or config.json, resolved
    # by EngineArgs (core/generation_defaults.py); None: the tokenizer's EOS.
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        unknown = [k for k, _ in self.generation_defaults if k not in GENERATION_DEFAULT_FIELDS]
        if unknown:
            raise ValueError(f"generation_defaults may only set {GENERATION_DEFAULT_FIELDS}, "
                             f"got {unknown}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized by the backend from memory
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float = 2.0  # CPU: how much host memory the KV cache may take
    # Tokens back from the newest that any layer still reads, when every layer attends to a
    # sliding window (the largest one); None when some layer reads the whole context. Blocks
    # behind it are freed while a request runs (core/block_manager.py). Read from the model.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # The largest n of one request: each sample is a sequence of its own, and n=10**9 would
    # build that many before anything is checked. High enough for pass@k evaluations.
    max_num_samples: int = 256

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_samples < 1:
            raise ValueError(f"max_num_samples must be >= 1, got {self.max_num_samples}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is "
                f"disabled ({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """How the engine treats a backend that fails (docs/reliability.md)."""

    # A step with no reply after this long means a frozen worker. Generous: a first prefill
    # of a large model on a slow CPU may take minutes, and a false alarm costs every request.
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    # Restarts of a lost worker over the engine's life; past it, the engine stops serving.
    max_worker_restarts: int = DEFAULT_MAX_WORKER_RESTARTS
    # A worker process or rank not ready after this long is stuck, not slow: killed, and the
    # start fails saying so. Generous: a first start on a fresh machine builds the CPU
    # kernels (minutes on 2 cores) and may load a large model from a slow disk.
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.max_worker_restarts < 0:
            raise ValueError(
                f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")


EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")
# Ray's placement group strategies: how the ``ray`` executor's ranks (one bundle each) may
# share nodes. PACK (the default, as in vLLM): on as few nodes as possible.
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Where this engine sits among replicas, and how its model is split.

    Data parallel (core/data_parallel/): ``data_parallel_size`` engines serve one model side
    by side, this one is ``data_parallel_rank``. Tensor parallel (core/executor/,
    docs/distributed.md): each engine's model is split over ``tensor_parallel_size`` ranks,
    run by the ``distributed_executor_backend`` executor; a backend builds rank
    ``tensor_parallel_rank``'s share. Pipeline parallel: the layers are split over
    ``pipeline_parallel_size`` stages, each split over ``tensor_parallel_size`` ranks of
    its own; a backend builds stage ``pipeline_parallel_rank``'s layers. A backend that
    declares ``supports_data_parallel`` or ``supports_tensor_parallel`` uses them to take
    its share of the machine (the CPU backend: its share of the cores)."""

    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    pipeline_parallel_size: int = 1
    pipeline_parallel_rank: int = 0
    # None: "mp" when the model is split over several ranks, else "uniproc".
    distributed_executor_backend: str | None = None
    # Mixture-of-experts layers: whole experts per tensor-parallel rank instead of a slice
    # of each (cadence.distributed.held_experts; no effect on dense models or one rank).
    enable_expert_parallel: bool = False
    expert_placement_strategy: str = "linear"
    # The ``ray`` executor: how its placement group (one bundle per rank) spreads the ranks
    # over the cluster's nodes (core/executor/ray_placement.py).
    ray_placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_rank must be in [0, "
                             f"{self.tensor_parallel_size}), got {self.tensor_parallel_rank}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if not 0 <= self.pipeline_parallel_rank < self.pipeline_parallel_size:
            raise ValueError(f"pipeline_parallel_rank must be in [0, "
                             f"{self.pipeline_parallel_size}), got "
                             f"{self.pipeline_parallel_rank}")
        if self.expert_placement_strategy not in EXPERT_PLACEMENTS:
            raise ValueError(f"expert_placement_strategy must be one of {EXPERT_PLACEMENTS}, "
                             f"got {self.expert_placement_strategy!r}")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"ray_placement_strategy must be one of "
                             f"{RAY_PLACEMENT_STRATEGIES}, got {self.ray_placement_strategy!r}")
        executor = self.distributed_executor_backend
        if executor is not None and executor not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{EXECUTOR_BACKENDS}, got {executor!r}")
        if executor == "uniproc" and self.world_size > 1:
            raise ValueError(f"{self.world_size} ranks (--tensor-parallel-size "
                             f"{self.tensor_parallel_size} x --pipeline-parallel-size "
                             f"{self.pipeline_parallel_size}) need one process each: use "
                             "--distributed-executor-backend mp (or ray), not uniproc")

    @property
    def world_size(self) -> int:
        """Ranks one engine's model is split over."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def rank(self) -> int:
        """This rank's index among ``world_size``: stage-major, as torch.distributed sees
        it (stage s's tensor-parallel rank t is s * tensor_parallel_size + t)."""
        return self.pipeline_parallel_rank * self.tensor_parallel_size + \
            self.tensor_parallel_rank

    def with_rank(self, rank: int) -> ParallelConfig:
        """This config as global rank ``rank`` of ``world_size`` sees it."""
        import dataclasses

        stage, tp_rank = divmod(rank, self.tensor_parallel_size)
        return dataclasses.replace(self, tensor_parallel_rank=tp_rank,
                                   pipeline_parallel_rank=stage)

    @property
    def executor(self) -> str:
        """The executor that runs this engine's ranks (the default resolved)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else "uniproc"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    backend: str = "cpu"
    disable_async_output_proc: bool = False
    # Plan step N+1 while step N computes (core/scheduling/, docs/async_scheduling.md).
    async_scheduling: bool = False
    # Backend-specific options (e.g. {"overlap": "thread"} or {"enforce_eager": True}),
    # passed through untouched so plugins can add knobs without core changes.
    backend_options: tuple[tuple[str, object], ...] = ()
    fault_config: FaultConfig = FaultConfig()
    parallel_config: ParallelConfig = ParallelConfig()
    # LoRA adapters (cadence/lora): None when the engine serves none.
    lora_config: LoRAConfig | None = None
    # Speculative decoding (cadence/spec_decode): None when off.
    speculative_config: SpeculativeConfig | None = None

    @property
    def plans_with_placeholders(self) -> bool:
        """Whether steps are planned with placeholders for tokens not yet sampled (the
        async scheduling strategy). Under pipeline parallel, async scheduling is the
        pipeline's own strategy instead: it already plans each micro-batch while the others
        compute, and a request is never planned while its token is in flight (only a
        long prompt's non-final chunks follow each other), so no token is ever planned
        before it is known (docs/distributed.md)."""
        return self.async_scheduling and self.parallel_config.pipeline_parallel_size == 1

    def backend_option(self, name: str, default: object = None) -> object:
        return dict(self.backend_options).get(name, default)
