"""User-facing engine arguments: one flat dataclass for the Python API and the CLI, turned
into the frozen ``EngineConfig`` once every "auto" value is resolved."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields

from cadence.config import (
    DEFAULT_MAX_WORKER_RESTARTS,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    DTYPES,
    CacheConfig,
    EngineConfig,
    FaultConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from cadence.engine_arg_checks import MAX_TIMEOUT_S, check_engine_args
from cadence.generation_defaults import load_eos_ids, load_generation_defaults
from cadence.lora.adapter import check_lora_architecture
from cadence.lora.config import LoRAConfig
from cadence.model_limits import (
    check_architecture,
    has_lm_head,
    longest_context,
    model_kv_window,
)
from cadence.pooling.config import load_pooler_config
from cadence.quantization import check_quantization
from cadence.quantization.checkpoint import resolve_packed
from cadence.spec_decode.config import SpeculativeConfig


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None
    backend: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_samples: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    disable_async_output_proc: bool = False
    # None: the backend's choice (cadence_configure may turn it on where it was measured
    # faster, as the CUDA backend does); False or True: as asked.
    async_scheduling: bool | None = None
    tokenizer: str | None = None
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S
    max_worker_restarts: int = DEFAULT_MAX_WORKER_RESTARTS
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S
    generation_config: str = "auto"
    backend_options: dict = field(default_factory=dict)
    revision: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False
    expert_placement_strategy: str = "linear"
    ray_placement_strategy: str = "PACK"
    # Embeddings (cadence/pooling): None reads the model folder's sentence-transformers
    # files, else last-token pooling, normalized.
    pooling_type: str | None = None
    pooling_normalize: bool | None = None
    # LoRA adapters (cadence/lora): served only with enable_lora.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (cadence/spec_decode): a dict or JSON object with vLLM's keys,
    # e.g. {"method": "ngram", "num_speculative_tokens": 3}; None: off.
    speculative_config: dict | str | None = None
    # Weights kept compressed (cadence/quantization): "gguf" runs a GGUF file's blocks.
    quantization: str | None = None

    def resolve_model(self) -> str:
        """The local folder ``model`` names: a folder, a GGUF file, a Hub id or the default."""
        from cadence.model_source import resolve_model_source

        return resolve_model_source(self.model, self.revision)

    def create_engine_config(self, extra: dict | None = None) -> EngineConfig:
        """Resolve auto values, let plugins adjust (``cadence_configure``), then freeze."""
        from cadence.plugins import get_registry

        args = asdict(self)
        check_engine_args(args)
        if args["seed"] is None:  # vLLM's: no fixed seed, so one drawn for this engine
            args["seed"] = int.from_bytes(os.urandom(8), "little") >> 1
        args["model"] = self.resolve_model()
        args["backend_options"] = dict(self.backend_options)
        args.update(extra or {})
        spec = SpeculativeConfig.parse(args["speculative_config"])
        if spec is not None and args["async_scheduling"] is None:
            # Speculation plans each step on the tokens the last one kept, not on async
            # scheduling's placeholders: a backend's default gives way to it (the engine
            # refuses the two asked for together).
            args["async_scheduling"] = False
        quantization = resolve_packed(check_quantization(args["quantization"]),
                                      args["model"])
        args["quantization"] = quantization
        if os.path.isdir(args["model"]):
            # First: the backends' adjustments below read config.json too, and checks
            # written for the supported families would fail obscurely on another.
            check_architecture(args["model"])
        requested = args["backend"]
        if requested == "auto":
            # The plugins' adjustments are those of the backend auto picks (its dtype, its
            # options); the engine picks it again, saying why.
            args["backend"] = get_registry().select("auto")[0].name
        get_registry().hook.cadence_configure(config=args)
        args["backend"] = requested
        model = args["model"]
        if not os.path.isdir(model):
            raise ValueError(f"model path {model!r} does not exist or is not a directory")
        from cadence.model_source import check_tokenizer_folder, resolve_model_source

        if args["tokenizer"] is not None:
            args["tokenizer"] = resolve_model_source(args["tokenizer"])
        _config_json(model)  # before the tokenizer: an empty folder lacks config.json first
        check_tokenizer_folder(args["tokenizer"] or model)
        max_len = _max_position_embeddings(model) if args["max_model_len"] is None \
            else args["max_model_len"]
        longest, why = longest_context(model)
        if longest and max_len > longest:
            raise ValueError(f"max_model_len={max_len} is larger than the model allows: {why}")
        dtype = args["dtype"]
        if dtype == "auto":
            # fp32 on CPUs without native bf16 (AVX-512 BF16/AMX) is far faster; see
            # docs/performance.md. Device backends pick their dtype through cadence_configure.
            dtype = "float32"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES + ('auto',)}, got {dtype!r}")
        if quantization == "gguf":
            from cadence.quantization.gguf_export import ensure_blocks
            from cadence.scheduling import check_quantization_support

            # Before the export, which can take minutes: a backend named here that does not
            # run it is refused now (the engine checks again, "auto" included).
            info = get_registry().backends.get(args["backend"])
            if info is not None:
                check_quantization_support(info.cls, get_registry(), quantization)
            ensure_blocks(model)
        defaults = load_generation_defaults(model, args["generation_config"])
        pooler = load_pooler_config(model, args["pooling_type"], args["pooling_normalize"])
        lora = None
        if args["enable_lora"]:
            lora = LoRAConfig(args["max_loras"], args["max_lora_rank"], args["max_cpu_loras"])
            check_lora_architecture(model)
        batched = args["max_num_batched_tokens"]
        if batched is None:
            batched = max(8192, max_len if not args["enable_chunked_prefill"] else 0)
        return EngineConfig(
            model_config=ModelConfig(model, dtype, max_len, args["seed"], args["tokenizer"],
                                     generation_defaults=defaults, pooler_config=pooler,
                                     has_lm_head=has_lm_head(model),
                                     quantization=quantization,
                                     eos_token_ids=load_eos_ids(model,
                                                                args["generation_config"])),
            cache_config=CacheConfig(args["block_size"], args["num_kv_blocks"],
                                     args["enable_prefix_caching"],
                                     sliding_window=model_kv_window(model)),
            scheduler_config=SchedulerConfig(args["max_num_seqs"], batched, max_len,
                                             args["enable_chunked_prefill"],
                                             args["scheduling_policy"],
                                             max_num_samples=args["max_num_samples"]),
            backend=args["backend"],
            disable_async_output_proc=args["disable_async_output_proc"],
            async_scheduling=bool(args["async_scheduling"]),
            backend_options=tuple(sorted(args["backend_options"].items())),
            # inf, no limit, as the longest wait the OS takes: every wait on a step (select,
            # poll, joins) is given it as a number.
            fault_config=FaultConfig(min(float(args["step_timeout"]), MAX_TIMEOUT_S),
                                     int(args["max_worker_restarts"]),
                                     float(args["startup_timeout"])),
            parallel_config=ParallelConfig(
                tensor_parallel_size=int(args["tensor_parallel_size"]),
                pipeline_parallel_size=int(args["pipeline_parallel_size"]),
                distributed_executor_backend=args["distributed_executor_backend"],
                enable_expert_parallel=bool(args["enable_expert_parallel"]),
                expert_placement_strategy=args["expert_placement_strategy"],
                ray_placement_strategy=args["ray_placement_strategy"]),
            lora_config=lora,
            speculative_config=spec,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine's flags (and every plugin's, ``cadence_add_cli_options``) to
        ``parser``; ``from_cli_args`` reads them back."""
        from cadence.cli.engine_flags import add_engine_flags

        add_engine_flags(parser)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> tuple[EngineArgs, dict]:
        """The EngineArgs plus the plugin flags (everything else in the namespace)."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in vars(ns).items() if k in names}
        if kwargs.get("backend") is None:
            kwargs.pop("backend", None)
        extra = {k: v for k, v in vars(ns).items() if k not in names and not callable(v)}
        extra = {k: v for k, v in extra.items() if _jsonable(v)}
        return cls(**kwargs), extra


def _jsonable(v: object) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def trained_dtype(model: str) -> str | None:
    """The dtype a model folder's checkpoint was released in (config.json's ``dtype`` or
    ``torch_dtype``), or None when it does not say. Backends use it to resolve
    ``--dtype auto``.

    The built-in default model is the exception: its folder holds fp32 weights dequantized
    from a 4-bit GGUF, but SmolLM2 itself was trained and released in bfloat16.
    """
    from cadence.default_model import DEFAULT_MODEL_TRAINED_DTYPE, is_default_model_folder

    if is_default_model_folder(model):
        return DEFAULT_MODEL_TRAINED_DTYPE
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


def _config_json(model: str) -> object:
    """The model folder's config.json; a ValueError when there is none or it does not
    parse (checked first: every later check reads it)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {model!r} has no config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model folder {model!r} has an unreadable config.json: {e}") from e


def _max_position_embeddings(model: str) -> int:
    """config.json's context length, or where it names none, the default of the config
    class transformers reads it with (LlamaConfig's 2048, ...), as transformers does."""
    cfg = _config_json(model)
    # GPT-2's config.json names it n_positions (transformers maps the two).
    value = cfg.get("max_position_embeddings") or cfg.get("n_positions") \
        if isinstance(cfg, dict) else None
    if value is None and isinstance(cfg, dict):
        try:
            from transformers import AutoConfig

            value = getattr(AutoConfig.for_model(cfg.get("model_type")),
                            "max_position_embeddings", None)
        except (ImportError, ValueError):  # an unknown model_type: named below
            value = None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model folder {model!r}: config.json's max_position_embeddings must "
                         f"be a positive integer, got {value!r}; pass max_model_len "
                         "(--max-model-len) to set the context length")
    return value
