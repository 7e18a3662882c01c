"""The ``model_args`` of lm-eval's ``lmpool`` model, checked, and the pool checked before use.

A misspelled argument, a value of the wrong type, an unreachable Redis or a model no worker
has served fail at once, with one error that names the argument (``SettingsError``, a
``ValueError``; ``PoolUnreachable``, a ``ConnectionError``), in about a second at most.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shared.errors import PoolUnreachable, SettingsError
from shared.keys import Keys
from shared.redis_conn import masked_url, probe
from shared.settings import Settings

DEFAULT_CONCURRENCY = 256
PREFLIGHT_TIMEOUT_S = 1.0
"""Redis connect and read timeout of the check before connecting."""
PASSED_BY_LM_EVAL = ("batch_size", "max_batch_size", "device", "trust_remote_code")
"""What lm-eval hands every model besides ``model_args``: accepted, not used (the workers batch,
the model runs on their devices, and code of the model's own is theirs to trust;
``--trust_remote_code`` also reaches the model this way)."""


@dataclass(frozen=True)
class HarnessArgs:
    """``--model_args`` of ``lm_eval --model lmpool``; unset ones come from ``LMPOOL_*``."""

    redis_url: str = ""
    """The pool's Redis (default ``LMPOOL_REDIS_URL``)."""
    model: str = ""
    """The name workers registered (default ``LMPOOL_MODEL_NAME`` / ``LMPOOL_MODEL``)."""
    timeout_s: float = 0.0
    """Seconds one request may wait (default ``LMPOOL_TIMEOUT_S``)."""
    connect_timeout_s: float = 0.0
    """Seconds to wait for a live worker of a model the pool knows
    (``LMPOOL_CONNECT_TIMEOUT_S``)."""
    key_prefix: str = ""
    """``LMPOOL_KEY_PREFIX`` of the pool."""
    priority: str = "low"
    """``low``: the offline streams, served after interactive work (as ``lmpool-score``)."""
    concurrency: int = DEFAULT_CONCURRENCY
    """Requests in flight at once."""
    max_length: int = 0
    """Tokens of a window (lm-eval's ``max_length``); 0: what the workers take."""
    max_gen_toks: int = 256
    """Default most tokens a generation makes (a task's ``max_gen_toks`` overrides it)."""
    add_bos_token: bool | None = None
    """As lm-eval's ``hf``: None keeps the tokenizer's own special tokens."""
    prefix_token_id: int | None = None
    """Context token of an empty context (default BOS, else EOS)."""
    lora: str | None = None
    """A LoRA adapter the pool serves."""
    seed: int = 1234
    """Base seed of sampled generations (each request's seed also hashes its context)."""

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> HarnessArgs:
        """Check names and types; fill unset ones from the environment's ``LMPOOL_*``."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - set(fields) - set(PASSED_BY_LM_EVAL))
        if unknown:
            raise SettingsError(
                f"lmpool model_args: unknown {', '.join(unknown)}; known: {', '.join(fields)}"
            )
        values = {k: _check(k, v, fields[k].type) for k, v in kwargs.items() if k in fields}
        if values.get("priority", "low") not in ("high", "low"):
            raise SettingsError(f"lmpool model_args priority={values['priority']!r}: high or low")
        for name in ("concurrency", "max_gen_toks"):
            if name in values and values[name] < 1:
                raise SettingsError(f"lmpool model_args {name}={values[name]} must be >= 1")
        for name in ("timeout_s", "connect_timeout_s", "max_length"):
            if name in values and values[name] <= 0:
                raise SettingsError(f"lmpool model_args {name}={values[name]} must be > 0")
        env = Settings.from_env()
        values.setdefault("redis_url", env.redis_url)
        values.setdefault("timeout_s", env.timeout_s)
        values.setdefault("connect_timeout_s", env.connect_timeout_s)
        values.setdefault("key_prefix", env.key_prefix)
        values.setdefault("model", env.served_model_name)
        return cls(**values)

    def settings(self) -> Settings:
        return Settings.from_env().replace(
            redis_url=self.redis_url,
            key_prefix=self.key_prefix,
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
        )


def _check(name: str, value: Any, typ: Any) -> Any:
    """``value`` as the field's type (``str``, ``int``, ``float``, ``bool``, or one of them
    ``| None``), or ``SettingsError`` naming the argument."""
    spelled = str(typ)
    base = spelled.split(" ")[0]
    if value is None and spelled.endswith("| None"):
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "str" and (isinstance(value, str) or number):
        return str(value)  # lm-eval parses a name like 7 as a number
    if (base == "bool" and isinstance(value, bool)) or (base == "int" and type(value) is int):
        return value
    if base == "float" and number:
        return float(value)
    raise SettingsError(f"lmpool model_args {name}={value!r}: expected {spelled}")


def preflight(args: HarnessArgs) -> None:
    """Fail fast and clearly where :meth:`RemoteLM.from_name` would retry or wait: Redis does
    not answer, or no worker has ever served ``args.model`` there."""
    import redis

    from shared.redis_conn import connect_redis_sync

    where = masked_url(args.redis_url)
    try:
        node = probe(args.redis_url, PREFLIGHT_TIMEOUT_S, blocking=True)
    except ValueError as e:
        raise SettingsError(f"lmpool model_args redis_url={where!r}: {e}") from None
    try:
        node.ping()
    except (redis.RedisError, OSError) as e:
        raise PoolUnreachable(f"lmpool cannot reach Redis at redis_url={where!r}: {e}") from None
    finally:
        node.close()
    client = connect_redis_sync(args.redis_url)
    try:
        known = sorted(m.decode() for m in client.smembers(Keys(args.key_prefix).models))
    finally:
        client.close()
    if args.model not in known:
        raise SettingsError(
            f"lmpool model_args model={args.model!r}: no worker has served it on {where}; "
            f"models there: {', '.join(known) or 'none'}"
        )
