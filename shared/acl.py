"""Least-privilege Redis ACL rules for workers and producers of one pool (key prefix).

``python -m shared.acl PREFIX`` prints both rules, ready for ``ACL SETUSER`` or an ACL file;
``python -m shared.acl PREFIX alice bob`` prints a producer rule per tenant of the pool;
README's security section shows them, and the tests run the pool under exactly these rules.
"""

from __future__ import annotations

import sys

# Commands a producer sends, directly or from the SUBMIT script (scripts run with the
# caller's permissions), plus connection set-up.
PRODUCER_COMMANDS = (
    "evalsha", "eval", "script|load", "script|exists", "rpush",  # SUBMIT
    "exists", "sadd", "srem", "zadd", "pexpire", "del", "xadd", "xlen", "hincrby",  # SUBMIT
    "getex",  # results (a result's first read gives it its TTL)
    "blmpop",  # replies
    "time",  # the server's clock, for request deadlines
    "hmget", "zmscore", "zremrangebyscore", "zcard", "pttl", "zrem",  # QUOTA, leases' end
    "acl|whoami",  # the producer's tenant is its ACL user
    "info",  # whether the server is a cluster node (asked once per connect)
    "zrangebyscore", "hgetall", "smembers", "xpending",  # discovery, error messages
    "scan", "unlink",  # clear_shared_cache
    "ping", "hello", "select", "auth", "client|setname",
)  # fmt: skip


def worker_rule(user: str, password: str, prefix: str = "lmpool") -> str:
    """A worker runs the model, serves streams and arq jobs: data commands on its prefix and
    on arq's fixed ``arq:*`` keys, nothing that administers the server."""
    return (
        f"user {user} on >{password} resetkeys ~{prefix}:* ~arq:* resetchannels "
        "-@all +@read +@write +@stream +@list +@hash +@set +@sortedset +@string +@keyspace "
        "+@scripting +@transaction +@connection -@dangerous +info +time "
        "+client|setname"
    )


ADAPTER_COMMANDS = ("hget", "hset", "hdel", "set")
"""Commands a producer sends to the run-time LoRA adapters' keys only (``producer.adapters``):
given by a selector of their own, so that no other key (results, metadata) can be set."""

TENANT_WRITES = (
    "{*}:stats", "{*}:due", "{*}:res:*", "{*}:wait:*", "{*}:tenants",  # SUBMIT, results
    "lora:*", "lorafile:*",  # run-time adapters
)  # fmt: skip
"""Keys a tenant's producer writes besides its own streams, quota and reply lists
(``shared.keys``)."""


def producer_rule(user: str, password: str, prefix: str = "lmpool", tenant: bool = False) -> str:
    """A producer submits requests and reads replies on its prefix: the commands it sends,
    no others, and no key outside the prefix (another prefix's keys stay unreadable).

    ``tenant``: the user is a tenant of a shared pool (``LMPOOL_TENANT``: a producer's tenant is
    its ACL user). It reads the whole prefix but writes requests only into its own streams
    (``P:{M:S}:high:USER``, ``P:{M:S}:low:USER``), so it cannot pass its requests off as
    another tenant's: Redis refuses them (NOPERM), inside the SUBMIT script too; and it pushes
    only onto its own reply lists (``P:reply:USER:*``), so it cannot answer another tenant's
    requests."""
    commands = " ".join(f"+{c}" for c in PRODUCER_COMMANDS)
    keys = f"~{prefix}:*"
    if tenant:
        own = [
            f"{{*}}:high:{user}",
            f"{{*}}:low:{user}",
            f"quota:{{{user}}}:*",  # its quota's use, leases and bucket, not its limits
            f"reply:{user}:*",  # its own reply lists: no answer of its own in another's
            *TENANT_WRITES,
        ]
        keys = f"%R~{prefix}:* " + " ".join(f"~{prefix}:{pattern}" for pattern in own)
    adapters = " ".join(
        [f"~{prefix}:lora:*", f"~{prefix}:lorafile:*", *(f"+{c}" for c in ADAPTER_COMMANDS)]
    )
    return (
        f"user {user} on >{password} resetkeys {keys} resetchannels -@all {commands} ({adapters})"
    )


if __name__ == "__main__":
    # python -m shared.acl [PREFIX [TENANT...]]: the rules of a pool, and of its tenants' users
    prefix = sys.argv[1] if len(sys.argv) > 1 else "lmpool"
    print(worker_rule(f"{prefix}-worker", "WORKER_PASSWORD", prefix))
    tenants = sys.argv[2:]
    if not tenants:
        print(producer_rule(f"{prefix}-producer", "PRODUCER_PASSWORD", prefix))
    for name in tenants:
        print(producer_rule(name, f"{name.upper()}_PASSWORD", prefix, tenant=True))
