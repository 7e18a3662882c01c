"""``python -m worker.quota`` (also ``lmpool-quota``): set, clear and show tenants' quotas.

    python -m worker.quota                                    # every quota, with its use
    python -m worker.quota alice --in-flight 64 --tokens-per-s 20000
    python -m worker.quota alice --clear

A quota holds a tenant's requests in flight (across all its producers and models) and the
prompt tokens it may send per second (a bucket of one second's tokens). Producers read it
before each call (``producer.quota``); a change applies within a second. 0 means no limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

from shared.keys import Keys, check_tenant
from shared.redis_conn import AnyRedis, connect_redis
from shared.registry import server_now_ms
from shared.settings import Settings

FIELDS = ("in_flight", "tokens_per_s")


async def read_quotas(redis: AnyRedis, keys: Keys) -> dict[str, dict[str, float]]:
    """Per tenant with a quota: its limits, requests in flight now, and the admitted and
    refused requests counted so far."""
    tenants = sorted(_s(t) for t in await redis.smembers(keys.quotas))  # type: ignore[misc]
    out: dict[str, dict[str, float]] = {}
    for tenant in tenants:  # one tenant's keys share a slot; tenants' do not
        limits = await redis.hmget(keys.quota(tenant), list(FIELDS))  # type: ignore[misc]
        use = await redis.hmget(keys.quota_use(tenant), ["admitted", "refused"])  # type: ignore[misc]
        alive = await redis.zcount(keys.quota_leases(tenant), await server_now_ms(redis), "+inf")
        out[tenant] = {
            **{f: float(v or 0) for f, v in zip(FIELDS, limits, strict=True)},
            "in_flight_now": int(alive),
            "admitted": int(use[0] or 0),
            "refused": int(use[1] or 0),
        }
    return out


async def set_quota(redis: AnyRedis, keys: Keys, tenant: str, limits: dict[str, float]) -> None:
    """Set (or, with every limit 0, clear) ``tenant``'s quota."""
    check_tenant(tenant)
    check_limits(limits)
    if not any(limits.values()):
        await redis.delete(keys.quota(tenant))
        await redis.srem(keys.quotas, tenant)  # type: ignore[misc]
        return
    await redis.hset(keys.quota(tenant), mapping=limits)  # type: ignore[misc]
    await redis.sadd(keys.quotas, tenant)  # type: ignore[misc]


def render(quotas: dict[str, dict[str, float]]) -> str:
    if not quotas:
        return "no tenant has a quota"
    return "\n".join(
        f"tenant {t}: in flight {int(q['in_flight_now'])} of {_limit(q['in_flight'])}, "
        f"prompt tokens/s {_limit(q['tokens_per_s'])}; {q['admitted']} requests admitted, "
        f"{q['refused']} refused"
        for t, q in quotas.items()
    )


def _limit(value: float) -> str:
    return f"{value:g}" if value else "no limit"


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def run(args: argparse.Namespace) -> None:
    redis = connect_redis(args.redis_url)
    keys = Keys(args.prefix)
    try:
        if args.tenant:
            limits = {"in_flight": args.in_flight, "tokens_per_s": args.tokens_per_s}
            await set_quota(redis, keys, args.tenant, {} if args.clear else limits)
        quotas = await read_quotas(redis, keys)
        print(json.dumps(quotas, indent=2) if args.json else render(quotas))
    finally:
        await redis.aclose()


def check_limits(limits: dict[str, float]) -> None:
    """``ValueError`` unless each limit is a finite number >= 0 and ``in_flight`` a whole
    number (a fraction of a request would refuse every call, ``nan`` would limit nothing)."""
    for name, value in limits.items():
        if name not in FIELDS:
            raise ValueError(f"{name!r} is not a quota limit (those are {', '.join(FIELDS)})")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} {value}: a limit is a finite number >= 0 (0: no limit)")
        if name == "in_flight" and value != int(value):
            raise ValueError(f"in_flight {value}: requests in flight is a whole number")


def _in_flight(text: str) -> float:
    return _limit_arg("in_flight", text)


def _tokens_per_s(text: str) -> float:
    return _limit_arg("tokens_per_s", text)


def _limit_arg(name: str, text: str) -> float:
    try:
        value = float(text)
        check_limits({name: value})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None
    return value


def main(argv: list[str] | None = None) -> int:
    settings = Settings.from_env()
    parser = argparse.ArgumentParser(prog="lmpool-quota", description=__doc__.splitlines()[0])
    parser.add_argument("tenant", nargs="?", help="the tenant to set; none: show every quota")
    parser.add_argument("--in-flight", type=_in_flight, default=0, metavar="N")
    parser.add_argument("--tokens-per-s", type=_tokens_per_s, default=0, metavar="R")
    parser.add_argument("--clear", action="store_true", help="remove the tenant's quota")
    parser.add_argument("--redis-url", default=settings.redis_url)
    parser.add_argument("--prefix", default=settings.key_prefix, help="key prefix")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    limited = bool(args.in_flight or args.tokens_per_s)
    if not args.tenant and (limited or args.clear):
        parser.error("name the tenant whose quota to set or clear")
    if args.clear and limited:
        parser.error("--clear removes the quota: give it without --in-flight/--tokens-per-s")
    if args.tenant:
        try:
            check_tenant(args.tenant)
        except ValueError as e:
            parser.error(str(e))
        if not args.clear and not (args.in_flight or args.tokens_per_s):
            parser.error(
                "give a limit above 0 with --in-flight and/or --tokens-per-s (0 is no limit: "
                "with neither above 0 there is no quota to set; --clear removes one)"
            )
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
