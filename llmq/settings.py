"""Settings from the environment, with embedded defaults. The only place llmq reads os.environ.

With nothing set, everything runs on one machine: a SQLite file and an auto-started Redis under
LLMQ_HOME, and the project's own default model. Reading settings starts nothing and writes nothing:
`llmq.bootstrap.bootstrap` fills in the embedded Redis and the default model where none is given.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from llmq.engine.config import QUANTIZATION_METHODS, EngineConfig
from llmq.engine.dtype import DTYPES


def _int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def _flag(name: str) -> bool | None:
    """A yes/no variable (1/0, true/false, yes/no); None when unset."""
    value = (os.environ.get(name) or "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name} must be 1 or 0 (true/false), got {value!r}")


def _str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _weights(name: str) -> tuple[tuple[str, float], ...]:
    """`tenant=weight` pairs, comma-separated (`acme=3,beta=0.5`)."""
    pairs = []
    for part in (os.environ.get(name) or "").split(","):
        if not part.strip():
            continue
        tenant, _, weight = part.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not tenant.strip() or not (0 < value < math.inf):
            raise ValueError(f"environment variable {name} must be tenant=weight pairs with positive weights, "
                             f"separated by commas (acme=3,beta=0.5); got {part.strip()!r}")
        pairs.append((tenant.strip(), value))
    return tuple(pairs)


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    value = (os.environ.get(name) or "").strip().lower() or default
    if value not in allowed:
        raise ValueError(f"environment variable {name} must be one of {', '.join(allowed)}, got {os.environ[name]!r}")
    return value


def _quantization(name: str) -> str | None:
    value = (os.environ.get(name) or "").strip().lower()
    if value and value not in QUANTIZATION_METHODS:
        raise ValueError(f"environment variable {name} must be one of {', '.join(QUANTIZATION_METHODS)} "
                         f"(or unset for none), got {os.environ[name]!r}")
    return value or None


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    redis_url: str | None  # None until bootstrapped: the embedded Redis under `home`
    model_path: str | None  # None until bootstrapped: the default model, made once under `home`
    model_name: str | None  # the id clients send as "model"; default: the model folder's name
    port: int = 8000
    embedded_redis_port: int = 6390
    max_upload_bytes: int = 200 * 1024 * 1024
    max_batch_lines: int = 50_000
    # Server-wide defaults of the per-key limits (app/limits.py); a key's own values override them.
    rate_limit_rpm: int = 0  # requests per minute per key; 0 = unlimited
    rate_limit_tpm: int = 0  # tokens per minute per key (prompt + max_tokens x choices); 0 = unlimited
    max_tokens_limit: int = 0  # the largest max_tokens a request may ask for; 0 = the model's context
    # One request's size (a batch line's too): its choices (prompts x n), and the tokens it may use
    # (prompt tokens + max_tokens x choices); 0 = unlimited. Bounds what one request holds a worker for.
    max_request_choices: int = 2048
    max_request_tokens: int = 1_000_000
    visibility_timeout: int = 3600  # seconds before Redis redelivers an unacknowledged task
    stream_maxlen: int = 10_000  # entries kept per request stream
    stream_ttl: int = 24 * 3600  # seconds a finished request's stream stays replayable
    heartbeat_seconds: int = 2
    lease_seconds: int = 30  # a dead worker's requests are taken over this long after its last heartbeat
    shutdown_grace_seconds: int = 30  # a stopping worker (SIGTERM) hands its work back within this
    sweep_seconds: int = 10  # how often a worker looks for batches past their completion window
    redis_retry_seconds: int = 30  # how long a call waits for Redis to come back before it fails
    # How long a request whose tokens could not be written (Redis away past redis_retry_seconds) waits
    # for Redis to answer again, to go on from its checkpoint, before it fails.
    redis_outage_seconds: int = 600
    device: str = "cpu"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None
    tensor_parallel_size: int = 1  # a worker drives this many ranks x pipeline_parallel_size (one GPU each)
    pipeline_parallel_size: int = 1
    dtype: str = "auto"  # the engine's compute dtype: auto (llmq/engine/dtype.py), float32, float16, bfloat16
    quantization: str | None = None  # quantize the served model at load: int8 or int4 (EngineConfig)
    quantization_group_size: int = 128
    async_scheduling: bool | None = None  # EngineConfig.async_scheduling; None: on for one CUDA device
    cpu_kernels: bool | None = None  # EngineConfig.cpu_kernels; None: on a CPU, where they build
    worker_threads: int | None = None  # Celery threads per worker; default: 2 x max_num_seqs
    # Fair share: each tenant's weight (default 1) in the engine's split of slots and tokens, and the
    # task threads one tenant may hold on a worker (default: max_num_seqs, enough to fill the engine);
    # the rest wait for their turn (workers/tenant_intake.py), so other tenants always find a thread.
    tenant_weights: tuple[tuple[str, float], ...] = ()
    tenant_threads: int | None = None
    engine_nice: int | None = None  # see resolved_engine_nice
    background_stream_writes: bool | None = None  # see resolved_background_stream_writes
    # Run the engine in a process of its own (workers/engine_process.py) rather than in the Celery
    # worker's: it then shares no interpreter lock with the task threads.
    engine_process: bool = True
    # The autoscaler (`llmq autoscale`; validated by llmq/autoscale/config.py, where each is explained).
    autoscale_min: int = 1  # workers kept per model, also outside the profile; 0 scales to zero
    autoscale_max: int = 1
    autoscale_upscale_delay: int = 30  # seconds a decision to add workers must hold before it acts
    autoscale_downscale_delay: int = 600  # seconds a decision to remove workers must hold
    autoscale_target_ongoing: int | None = None  # requests per worker, queued ones included; default max_num_seqs
    autoscale_tick_seconds: int = 5
    autoscale_rate_half_life: int = 30  # seconds: the smoothed arrival and completion rates' half-life
    autoscale_startup_seconds: int = 60  # a worker's start-up time until one is measured
    autoscale_profile: str | None = None  # workers kept warm by hour of the week, or "predict"
    autoscale_backend: str = "local"
    # Metrics (GET /metrics): each worker's request timings, kept on its engine loop and sent with its
    # heartbeats (workers/request_metrics.py); off (LLMQ_METRICS=0) to measure what they cost.
    metrics: bool = True
    # The dashboard's session cookie (app/dashboard/session.py): the key that signs it, the same in
    # every web process (unset: one made once under `home`, which serves the web processes of one
    # machine); and whether it is sent over HTTPS only (unset: when the request came over HTTPS).
    secret_key: str | None = None
    secure_cookies: bool | None = None

    @classmethod
    def from_env(cls) -> "Settings":
        home = Path(_str("LLMQ_HOME") or Path.home() / ".cache" / "llmq")
        return cls(
            home=home,
            database_url=_str("DATABASE_URL", f"sqlite:///{home / 'llmq.db'}"),
            redis_url=_str("REDIS_URL"),
            model_path=_str("MODEL_PATH"),
            model_name=_str("MODEL_NAME"),
            port=_int("PORT", 8000),
            embedded_redis_port=_int("LLMQ_EMBEDDED_REDIS_PORT", 6390),
            max_upload_bytes=_int("LLMQ_MAX_UPLOAD_BYTES", 200 * 1024 * 1024),
            max_batch_lines=_int("LLMQ_MAX_BATCH_LINES", 50_000),
            rate_limit_rpm=_int("LLMQ_RATE_LIMIT_RPM", 0),
            rate_limit_tpm=_int("LLMQ_RATE_LIMIT_TPM", 0),
            max_tokens_limit=_int("LLMQ_MAX_TOKENS_LIMIT", 0),
            max_request_choices=_int("LLMQ_MAX_REQUEST_CHOICES", 2048),
            max_request_tokens=_int("LLMQ_MAX_REQUEST_TOKENS", 1_000_000),
            visibility_timeout=_int("LLMQ_VISIBILITY_TIMEOUT", 3600),
            stream_maxlen=_int("LLMQ_STREAM_MAXLEN", 10_000),
            stream_ttl=_int("LLMQ_STREAM_TTL", 24 * 3600),
            heartbeat_seconds=_int("LLMQ_HEARTBEAT_SECONDS", 2),
            lease_seconds=_int("LLMQ_LEASE_SECONDS", 30),
            shutdown_grace_seconds=_int("LLMQ_SHUTDOWN_GRACE_SECONDS", 30),
            sweep_seconds=_int("LLMQ_SWEEP_SECONDS", 10),
            redis_retry_seconds=_int("LLMQ_REDIS_RETRY_SECONDS", 30),
            redis_outage_seconds=_int("LLMQ_REDIS_OUTAGE_SECONDS", 600),
            device=_str("LLMQ_DEVICE", "cpu"),
            max_num_seqs=_int("LLMQ_MAX_NUM_SEQS", 128),
            max_num_batched_tokens=_int("LLMQ_MAX_NUM_BATCHED_TOKENS", 2048),
            kv_cache_bytes=_int("LLMQ_KV_CACHE_BYTES", 0) or None,
            tensor_parallel_size=_int("LLMQ_TENSOR_PARALLEL_SIZE", 1),
            pipeline_parallel_size=_int("LLMQ_PIPELINE_PARALLEL_SIZE", 1),
            dtype=_choice("LLMQ_DTYPE", ("auto", *DTYPES), "auto"),
            quantization=_quantization("LLMQ_QUANTIZATION"),
            quantization_group_size=_int("LLMQ_QUANTIZATION_GROUP_SIZE", 128),
            async_scheduling=_flag("LLMQ_ASYNC_SCHEDULING"),
            cpu_kernels=_flag("LLMQ_CPU_KERNELS"),
            worker_threads=_int("LLMQ_WORKER_THREADS", 0) or None,
            tenant_weights=_weights("LLMQ_TENANT_WEIGHTS"),
            tenant_threads=_int("LLMQ_TENANT_THREADS", 0) or None,
            engine_nice=_int("LLMQ_ENGINE_NICE", None),
            background_stream_writes=_flag("LLMQ_BACKGROUND_STREAM_WRITES"),
            engine_process=_flag("LLMQ_ENGINE_PROCESS") is not False,
            # The autoscaler's.
            autoscale_min=_int("LLMQ_AUTOSCALE_MIN", 1),
            autoscale_max=_int("LLMQ_AUTOSCALE_MAX", 1),
            autoscale_upscale_delay=_int("LLMQ_AUTOSCALE_UPSCALE_DELAY", 30),
            autoscale_downscale_delay=_int("LLMQ_AUTOSCALE_DOWNSCALE_DELAY", 600),
            autoscale_target_ongoing=_int("LLMQ_AUTOSCALE_TARGET_ONGOING", 0) or None,
            autoscale_tick_seconds=_int("LLMQ_AUTOSCALE_TICK_SECONDS", 5),
            autoscale_rate_half_life=_int("LLMQ_AUTOSCALE_RATE_HALF_LIFE", 30),
            autoscale_startup_seconds=_int("LLMQ_AUTOSCALE_STARTUP_SECONDS", 60),
            autoscale_profile=_str("LLMQ_AUTOSCALE_PROFILE"),
            autoscale_backend=_str("LLMQ_AUTOSCALE_BACKEND", "local"),
            # Metrics
            metrics=_flag("LLMQ_METRICS") is not False,
            # The dashboard
            secret_key=_str("LLMQ_SECRET_KEY"),
            secure_cookies=_flag("LLMQ_SECURE_COOKIES"),
        )

    def resolved_engine_nice(self) -> int:
        """The nice value of the engine's loop thread and the CPU threads it computes with. By default
        3 on the CPU, where those threads share the cores with the web server, Redis and the worker's
        task threads: these then run first when they wake, so a step's token events go out sooner. On
        the 2-core development machine, alternated with nice 0 over 24 and 30 rounds, that took 0.7 ms
        off the step -> SSE latency (p50 3.5-4.1 ms against 4.3-4.7) at no cost in throughput that
        the runs could tell; at 10 it cost about a tenth (OpenMP halves wait for each preempted half).
        0 on a GPU, where the engine's threads mostly wait for the device. A floor: a worker started
        at a higher nice value keeps it."""
        if self.engine_nice is not None:
            return self.engine_nice
        return 3 if self.device == "cpu" else 0

    def resolved_background_stream_writes(self) -> bool:
        """Whether a thread of its own writes each engine step's token events (workers/step_writer.py)
        while the next step runs: by default on a GPU, where the device would idle while the loop
        writes, and not on the CPU, where the write and the step compete for the same cores."""
        if self.background_stream_writes is not None:
            return self.background_stream_writes
        return self.device != "cpu"

    def resolved_worker_threads(self) -> int:
        """A worker's Celery threads: by default room for one tenant's share and as much again."""
        return self.worker_threads or 2 * self.max_num_seqs

    def resolved_tenant_threads(self) -> int:
        """The task threads one tenant may hold on a worker (never all of them while there are two)."""
        return max(1, min(self.tenant_threads or self.max_num_seqs, self.resolved_worker_threads() - 1))

    @property
    def heartbeat_stale_after(self) -> float:
        """How old a worker's heartbeat may be before the web counts it gone (a few missed beats)."""
        return 3 * self.heartbeat_seconds + 5

    def tenant_weight(self, tenant: str) -> float:
        return dict(self.tenant_weights).get(tenant, 1.0)

    @property
    def bootstrapped(self) -> bool:
        return self.redis_url is not None and self.model_path is not None

    def resolved_model_name(self) -> str:
        """The id clients send as "model": MODEL_NAME, else the model folder's name."""
        return self.model_name or Path(self._require("model_path")).name

    def engine_config(self) -> EngineConfig:
        """The served model's EngineConfig, from the engine settings here."""
        return EngineConfig(model=self._require("model_path"), device=self.device, dtype=self.dtype,
                            max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            tensor_parallel_size=self.tensor_parallel_size,
                            pipeline_parallel_size=self.pipeline_parallel_size, quantization=self.quantization,
                            quantization_group_size=self.quantization_group_size,
                            async_scheduling=self.async_scheduling, cpu_kernels=self.cpu_kernels,
                            **({"kv_cache_bytes": self.kv_cache_bytes} if self.kv_cache_bytes else {}))

    def _require(self, name: str) -> str:
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(f"Settings.{name} is not set: pass the settings through llmq.bootstrap.bootstrap() "
                               "first, which starts the embedded Redis and makes the default model where none is given")
        return value


def queue_name(model_name: str) -> str:
    """Each model has its own Celery queue, so workers of different models share one broker."""
    return f"llmq.{model_name}"
