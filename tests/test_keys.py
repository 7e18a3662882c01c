"""The key layout: one table in shared/keys.py, the same table in docs/architecture.md, and every
key that Keys builds matches one of its rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared.keys import KEY_TABLE, Keys, key_table

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
# A sample value per placeholder of the table's patterns.
SAMPLE = {
    "M": "m1",
    "S": "3",
    "D": "d" * 40,
    "C": "c1",
    "W": "w1",
    "N": "ad",
    "H": "h1",
    "J": "j1",
    "T": "t1",
}


def _pattern(row: str) -> re.Pattern[str]:
    """A table row's key as a regex over keys built with SAMPLE values and prefix ``pre``."""
    parts = re.split(r"([PMSDCWNHJT])", row)
    out = ""
    for part in parts:
        if part == "P":
            out += "pre"
        elif part in SAMPLE:
            out += re.escape(SAMPLE[part])
        else:
            out += re.escape(part)
    return re.compile(out + "$")


def _built() -> list[str]:
    k = Keys("pre")
    m, s, d = SAMPLE["M"], int(SAMPLE["S"]), SAMPLE["D"]
    return [
        k.models,
        k.arq_queue,
        k.meta(m),
        k.workers(m),
        k.worker(SAMPLE["W"]),
        k.lease(m, s),
        k.dead(m),
        k.job_progress(SAMPLE["J"]),
        k.reply(SAMPLE["C"]),
        k.lora_registry(m),
        k.lora_file(m, SAMPLE["N"], SAMPLE["H"]),
        k.stream(m, "high", s),
        k.stream(m, "low", s),
        k.stream(m, "high", s, SAMPLE["T"]),
        k.stream(m, "low", s, SAMPLE["T"]),
        k.tenants(m, s),
        k.stats(m, s),
        k.result(m, s, d),
        k.due(m, s),
        k.waiters(m, s, d),
        k.quotas,
        k.quota(SAMPLE["T"]),
        k.quota_use(SAMPLE["T"]),
        k.quota_bucket(SAMPLE["T"]),
        k.quota_leases(SAMPLE["T"]),
    ]


def test_doc_has_the_table() -> None:
    doc = DOC.read_text()
    begin, end = "<!-- keys:begin -->\n", "<!-- keys:end -->"
    assert begin in doc and end in doc
    assert doc.split(begin, 1)[1].split(end, 1)[0] == key_table(), (
        "docs/architecture.md has a stale key table: paste `python -m shared.keys` in"
    )


@pytest.mark.parametrize("key", _built())
def test_every_built_key_has_one_row(key: str) -> None:
    rows = [row for row, _, _ in KEY_TABLE if _pattern(row).match(key)]
    assert len(rows) == 1, f"{key} matches {rows} in KEY_TABLE"


def test_every_row_is_built() -> None:
    built = _built()
    for row, _, _ in KEY_TABLE:
        assert any(_pattern(row).match(key) for key in built), f"no Keys method builds {row}"


def test_ids_read_back_from_their_keys() -> None:
    k = Keys("tenant:a")
    assert k.job_id_of(k.job_progress("j:1-2").encode()) == "j:1-2"
    assert k.worker_id_of(k.worker("host:123:ab")) == "host:123:ab"
