"""The arq job ``score_file``: its arguments, serializer and progress fields, defined once in
``producer.scoring.job``, agree with the enqueuer, the CLI, the worker's function and README.

No Redis here: the arq pool and the job's body are replaced by recorders
(``tests/test_score_cli.py`` runs the job end to end).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

import producer.scoring.job as job
import worker.jobs
from producer.scoring.cli import build_parser, main
from producer.scoring.job import (
    JOB_NAME,
    JOB_STATES,
    PROGRESS_FIELDS,
    ProgressHash,
    ScoreFileArgs,
    pack_job,
    unpack_job,
)
from producer.scoring.options import ScoreOptions
from producer.scoring.run import ScoreStats

README = Path(__file__).resolve().parent.parent / "README.md"
URL = "redis://localhost:1/0"  # never connected to: the pool is a recorder
VALUES: dict[str, Any] = {
    "mode": "logprobs",
    "top_k": 5,
    "max_tokens": 7,
    "temperature": 0.5,
    "seed": 3,
    "concurrency": 9,
    "shard_rows": 11,
    "model": "m",
    "timeout_s": 2.5,
}
"""A value for every argument (all but ``mode`` differ from the default)."""


def readme_section() -> str:
    text = README.read_text()
    start = text.index("## Offline scoring")
    return text[start : text.index("\n## ", start + 1)]


def readme_table(section: str, header: str) -> list[list[str]]:
    """Cells of the table whose header row starts with ``| header |``."""
    lines = section[section.index(f"| {header} |") :].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


class RecordingPool:
    """Stands for arq's pool: records ``enqueue_job``'s arguments."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def enqueue_job(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return SimpleNamespace(job_id="job-1")

    async def aclose(self) -> None:
        pass


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[RecordingPool]:
    made: list[RecordingPool] = []

    async def create_pool(redis_settings: Any, **settings: Any) -> RecordingPool:
        made.append(RecordingPool(**settings))
        return made[-1]

    monkeypatch.setattr(job, "create_pool", create_pool)
    return made


def test_job_arguments_cover_the_score_options_with_the_same_defaults() -> None:
    assert list(VALUES) == list(ScoreFileArgs.names())
    options = [f.name for f in dataclasses.fields(ScoreOptions)]
    assert [n for n in ScoreFileArgs.names() if n not in options] == ["model", "timeout_s"]
    assert ScoreFileArgs().score_options() == ScoreOptions()
    assert ScoreFileArgs().job_kwargs() == {}
    args = ScoreFileArgs(**VALUES)
    assert ScoreFileArgs.from_kwargs(args.job_kwargs()) == args
    assert ScoreFileArgs.from_options(args.score_options(), model="m", timeout_s=2.5) == args
    with pytest.raises(TypeError, match="unknown score_file options"):
        ScoreFileArgs.from_kwargs({"topk": 3})


def test_worker_function_takes_the_paths_and_the_job_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert worker.jobs.score_file.__name__ == JOB_NAME
    params = list(inspect.signature(worker.jobs.score_file).parameters.values())
    assert [p.name for p in params[:3]] == ["ctx", "input_path", "output_path"]
    assert len(params) == 4 and params[3].kind is inspect.Parameter.VAR_KEYWORD
    seen: list[tuple[Any, ...]] = []

    async def body(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append((*args, kwargs))
        return {}

    monkeypatch.setattr(worker.jobs, "run_score_file", body)
    pool = SimpleNamespace(redis="R", settings="S", model="own")
    ctx = {"lmpool": pool, "job_id": "j"}
    asyncio.run(worker.jobs.score_file(ctx, "/in", "/out", **VALUES))
    assert seen == [
        ("R", "S", "j", "/in", "/out", ScoreFileArgs(**VALUES), {"default_model": "own"})
    ]
    with pytest.raises(TypeError, match="unknown score_file options"):
        asyncio.run(worker.jobs.score_file(ctx, "/in", "/out", topk=3))


def test_enqueuer_sends_the_job_arguments(pools: list[RecordingPool], tmp_path: Path) -> None:
    job_id = asyncio.run(
        job.enqueue_score_file(URL, tmp_path / "in", "out", job_id="job-1", **VALUES)
    )
    assert job_id == "job-1"
    (pool,) = pools
    assert pool.settings["job_serializer"] is pack_job
    assert pool.settings["job_deserializer"] is unpack_job
    ((args, kwargs),) = pool.calls
    assert args == (JOB_NAME, str(tmp_path / "in"), str(Path("out").absolute()))
    sent = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    assert ScoreFileArgs.from_kwargs(sent) == ScoreFileArgs(**VALUES)
    with pytest.raises(TypeError, match="unknown score_file options"):
        asyncio.run(job.enqueue_score_file(URL, "in", "out", topk=3))
    with pytest.raises(ValueError, match="top_k needs mode"):
        asyncio.run(job.enqueue_score_file(URL, "in", "out", mode="sample", top_k=3))
    assert len(pools) == 1  # refused before connecting


def test_cli_enqueue_maps_each_option_onto_the_argument_of_the_same_name(
    pools: list[RecordingPool], capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = vars(build_parser().parse_args([]))
    assert set(ScoreFileArgs.names()) <= set(defaults)
    argv = ["in.jsonl", "out.jsonl", "--redis-url", URL, "--enqueue"]
    for name, value in VALUES.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == "job-1"
    ((_, kwargs),) = pools[0].calls
    sent = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    assert ScoreFileArgs.from_kwargs(sent) == ScoreFileArgs(**VALUES)


def test_readme_lists_the_job_arguments_and_their_defaults() -> None:
    rows = readme_table(readme_section(), "argument")
    assert [row[0] for row in rows] == [f"`{name}`" for name in ScoreFileArgs.names()]
    effective = dataclasses.asdict(ScoreFileArgs().score_options())
    for name, default in rows:
        value = effective.get(name.strip("`"))
        if value is None:
            assert default.startswith(("none", "the worker's", "`LMPOOL_")), (name, default)
        else:
            assert re.sub(r"`", "", default) == str(value), (name, default)


def test_readme_lists_the_progress_fields_and_the_serializer() -> None:
    section = readme_section()
    for name in (*PROGRESS_FIELDS, "error", *JOB_STATES):
        assert f"`{name}`" in section, name
    assert pack_job.func is msgpack.packb and unpack_job.func is msgpack.unpackb
    for partial in (pack_job, unpack_job):
        kwargs = ", ".join(f"{k}={v}" for k, v in partial.keywords.items())
        assert f"functools.partial(msgpack.{partial.func.__name__}, {kwargs})" in section


def test_worker_settings_use_the_job_serializer() -> None:
    from worker.app import WorkerSettings

    assert worker.jobs.score_file in WorkerSettings.functions
    message = {"a": b"\x00raw", 1: [1.5, None, "text"]}
    packed = pack_job(message)
    assert WorkerSettings.job_serializer(message) == packed
    assert WorkerSettings.job_deserializer(packed) == unpack_job(packed) == message


def test_progress_hash_has_the_documented_fields() -> None:
    written: list[dict[str, str]] = []

    class Pipe:
        def hset(self, key: str, mapping: dict[str, str]) -> None:
            written.append(mapping)

        def expire(self, key: str, seconds: int) -> None:
            assert seconds == job.PROGRESS_TTL_S

        async def execute(self) -> None:
            pass

    redis: Any = SimpleNamespace(pipeline=lambda transaction: Pipe())
    paths = {"input": "/in", "output": "/out", "errors": "/out.errors.jsonl"}
    progress = ProgressHash(redis, "lmpool:job:j", ScoreStats(total=3), paths)
    asyncio.run(progress.write("running"))
    asyncio.run(progress.write("failed", error="OSError: disk full"))
    assert set(written[0]) == set(PROGRESS_FIELDS)
    assert set(written[1]) == {*PROGRESS_FIELDS, "error"}
    assert written[0]["state"] == "running" and written[0]["total"] == "3"
    assert all(isinstance(v, str) for v in written[1].values())
