"""Least-privilege Redis ACL rules for workers and producers of one tenant (key prefix).

``python -m shared.acl PREFIX`` prints both rules, ready for ``ACL SETUSER`` or an ACL file;
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


def producer_rule(user: str, password: str, prefix: str = "lmpool") -> str:
    """A producer submits requests and reads replies on its prefix: the commands it sends,
    no others, and no key outside the prefix (another tenant's keys stay unreadable)."""
    commands = " ".join(f"+{c}" for c in PRODUCER_COMMANDS)
    return f"user {user} on >{password} resetkeys ~{prefix}:* resetchannels -@all {commands}"


if __name__ == "__main__":
    tenant = sys.argv[1] if len(sys.argv) > 1 else "lmpool"
    print(worker_rule(f"{tenant}-worker", "WORKER_PASSWORD", tenant))
    print(producer_rule(f"{tenant}-producer", "PRODUCER_PASSWORD", tenant))
