"""Offline scoring (``lmpool-score`` and the arq job ``score_file``) through a real mock pool."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from poolkit import REPO, WorkerProcess

from localpool.redis_server import RedisServer
from producer import RemoteLM
from producer.score import enqueue_score_file, load_logprobs, read_job_progress
from producer.scoring.options import ScoreOptions
from producer.scoring.run import ScoreStats, score_jsonl
from shared.keys import Keys

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(120)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def cli(redis_url: str, *args: Any, model: str = MODEL) -> list[str]:
    return [
        sys.executable,
        "-m",
        "producer.score",
        *map(str, args),
        "--redis-url",
        redis_url,
        "--model",
        model,
        "--no-progress",
    ]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}


def run_cli(redis_url: str, *args: Any, model: str = MODEL) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli(redis_url, *args, model=model),
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=90,
    )


def prompt(i: int) -> list[int]:
    return [i % 250, i // 250 + 1, 7]


async def direct(redis_url: str, call: Callable[[RemoteLM], Any]) -> Any:
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        return await call(lm)


@pytest.fixture(scope="module")
def redis_url(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One flushed database and one mock worker for the whole module.

    Like conftest's ``workers(redis_url, backend="mock", mock_vocab_size=V)``, started once:
    worker start-up and shutdown would otherwise be most of this module's time.
    """
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    worker = WorkerProcess(
        redis_server.url, tmp_path_factory.mktemp("logs"), backend="mock", mock_vocab_size=V
    )
    worker.start().wait_ready()
    yield redis_server.url
    worker.stop()


def test_killed_run_resumes_without_duplicates_full_vectors(redis_url: str, tmp_path: Path) -> None:
    n = 1000
    rows: list[Any] = [{"id": f"p{i}", "ids": prompt(i)} for i in range(n - 1)]
    rows.append({"id": "text", "text": "hello"})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = (inp, out, "--shard-rows", 128)
    # A slow first run (2 in flight), killed once some lines are out.
    proc = subprocess.Popen(
        cli(redis_url, *args, "--concurrency", 2),
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 150:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    # What a kill in the middle of a write leaves: a row with no index line yet (the last line
    # is dropped), a torn index line, a torn shard row.
    lines = [line for line in out.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]
    assert 150 <= len(lines) < n
    first = len(lines) - 1
    out.write_bytes(b"".join(lines[:first]) + b'{"id":"p999","shard":"shar')
    last_shard = sorted((tmp_path / "out.jsonl.d").glob("shard-*.npy"))[-1]
    with last_shard.open("ab") as f:
        f.write(b"\x00" * 500)

    again = run_cli(redis_url, *args)
    assert again.returncode == 0, again.stderr
    assert f"{n - first} done, {first} skipped (already done), 0 failed" in again.stdout
    index = read_jsonl(out)
    ids = [r["id"] for r in index]
    assert len(ids) == n and set(ids) == {r["id"] for r in rows}
    assert not (tmp_path / "out.jsonl.errors.jsonl").exists()

    got_ids, matrix = load_logprobs(out)
    assert got_ids == ids and matrix.shape == (n, V) and matrix.dtype == np.float32
    shards = sorted((tmp_path / "out.jsonl.d").glob("shard-*.npy"))
    assert sum(np.load(s).shape[0] for s in shards) == n  # no orphan rows left
    assert all(np.load(s).shape[0] <= 128 for s in shards)
    prompts = {r["id"]: r.get("ids") for r in rows}

    async def expected(lm: RemoteLM) -> torch.Tensor:
        prompts["text"] = lm.tokenizer.encode("hello")
        return await lm.batch_next_token_logprobs([prompts[i] for i in ids])

    assert torch.equal(torch.from_numpy(matrix), asyncio.run(direct(redis_url, expected)))


def test_top_k_sample_and_score_modes(redis_url: str, tmp_path: Path) -> None:
    rows = [{"ids": prompt(i), "continuation": [i + 3, 9], "seed": i} for i in range(30)]
    rows.append({"id": "t", "text": "ab", "continuation_text": "cd"})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    outs = {m: tmp_path / f"{m}.jsonl" for m in ("topk", "sample", "score")}
    runs = [
        cli(redis_url, inp, outs["topk"], "--top-k", 5),
        cli(redis_url, inp, outs["sample"], "--mode", "sample", "--max-tokens", 6),
        cli(redis_url, inp, outs["score"], "--mode", "score"),
    ]
    procs = [
        subprocess.Popen(c, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for c in runs
    ]
    for p in procs:
        _, err = p.communicate(timeout=90)
        assert p.returncode == 0, err.decode()
    keys: list[Any] = [*range(1, 31), "t"]  # the line number, unless the line has an id

    async def check(lm: RemoteLM) -> None:
        ids = {k: prompt(k - 1) for k in keys[:-1]}
        ids["t"] = lm.tokenizer.encode("ab")
        conts: dict[Any, list[int]] = {k: [k + 2, 9] for k in keys[:-1]}
        conts["t"] = lm.tokenizer.encode("cd")
        topk = {r["id"]: r for r in read_jsonl(outs["topk"])}
        sample = {r["id"]: r for r in read_jsonl(outs["sample"])}
        score = {r["id"]: r for r in read_jsonl(outs["score"])}
        assert sorted(map(str, topk)) == sorted(map(str, sample)) == sorted(map(str, keys))
        assert sorted(map(str, score)) == sorted(map(str, keys))
        for k in keys:
            values, top = torch.topk(await lm.next_token_logprobs(ids[k]), 5)
            assert topk[k]["top_ids"] == top.tolist()
            assert torch.equal(torch.tensor(topk[k]["top_logprobs"]), values)
            seed = k - 1 if k != "t" else None
            if seed is not None:
                drawn = await lm.sample(ids[k], 6, lm.eos_token_ids, seed=seed)
                assert sample[k]["tokens"] == drawn
                assert sample[k]["text"] == lm.tokenizer.decode(drawn)
            expect = await lm.score(ids[k], conts[k])
            assert torch.equal(torch.tensor(score[k]["logprobs"]), expect)
            assert score[k]["total"] == pytest.approx(float(expect.sum()), abs=1e-5)
        assert 0 < len(sample["t"]["tokens"]) <= 6

    asyncio.run(direct(redis_url, check))


def test_a_resume_with_other_settings_is_refused(redis_url: str, tmp_path: Path) -> None:
    """One output never mixes settings: resuming a sample run with another --max-tokens or
    --seed, a top-k run with another k, or any run in another mode stops with exit status 2
    and the output as it was; the same settings resume (all lines skipped)."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"ids": prompt(i)} for i in range(10)])
    gen, top = tmp_path / "gen.jsonl", tmp_path / "top.jsonl"
    sample = ("--mode", "sample", "--max-tokens", 4, "--seed", 1)
    assert run_cli(redis_url, inp, gen, *sample).returncode == 0
    assert run_cli(redis_url, inp, top, "--top-k", 5).returncode == 0
    before = gen.read_bytes(), top.read_bytes()
    refused = [
        (gen, ("--mode", "sample", "--max-tokens", 5, "--seed", 1), "max_tokens 4 there, 5 now"),
        (gen, ("--mode", "sample", "--max-tokens", 4, "--seed", 2), "seed 1 there, 2 now"),
        (gen, ("--mode", "sample", "--max-tokens", 4), "seed 1 there, None now"),
        (gen, ("--mode", "score"), "another mode"),
        (top, ("--top-k", 3), "holds top-5 lines"),
    ]
    for out, args, says in refused:
        res = run_cli(redis_url, inp, out, *args)
        assert res.returncode == 2 and says in res.stderr, (args, res.stderr)
    assert (gen.read_bytes(), top.read_bytes()) == before
    again = run_cli(redis_url, inp, gen, *sample)
    assert again.returncode == 0 and "10 skipped" in again.stdout, again.stdout + again.stderr
    assert json.loads((tmp_path / "gen.jsonl.run.json").read_text()) == {
        "model": MODEL, "mode": "sample", "top_k": None, "max_tokens": 4, "temperature": 1.0,
        "seed": 1,
    }  # fmt: skip


def test_job_status_of_a_failed_job_says_so_to_a_script(redis_url: str) -> None:
    """``--job-status`` exits 1 for a job that failed (0 for one running); ``lmpool-status``
    shows its error beside its counters."""
    r = redis.Redis.from_url(redis_url)
    fields = {"state": "failed", "total": "0", "done": "0", "failed": "0", "rate": "0"}
    r.hset(Keys().job_progress("job-bad"), mapping={**fields, "error": "OSError: no such file"})
    r.hset(Keys().job_progress("job-ok"), mapping={**fields, "state": "running"})
    r.close()
    for job_id, code in (("job-bad", 1), ("job-ok", 0), ("job-never", 1)):
        res = subprocess.run(
            [sys.executable, "-m", "producer.score", "--job-status", job_id, "--redis-url",
             redis_url], cwd=REPO, env=env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert res.returncode == code, (job_id, res.stdout, res.stderr)
    status = subprocess.run(
        [sys.executable, "-m", "worker.status", "--redis-url", redis_url],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "job job-bad: failed 0/0 done, 0 failed, 0 lines/s: OSError: no such file" in status


def test_bad_lines_fail_alone_and_are_retried(redis_url: str, tmp_path: Path) -> None:
    rows: list[Any] = [{"id": f"r{i}", "ids": prompt(i)} for i in range(20)]
    rows[7] = {"id": "oov", "ids": [5, V]}
    rows[12] = '{"id": "torn", "ids": [1,'  # not JSON: named by its line number
    rows.append({"id": "r3", "ids": [1]})  # a second line with id r3
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    res = run_cli(redis_url, inp, out, "--top-k", 3)
    assert res.returncode == 1, res.stderr
    assert "18 done, 0 skipped (already done), 3 failed" in res.stdout
    failed = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl.errors.jsonl")}
    assert set(failed) == {"oov", 13, "r3"}
    assert "InvalidRequest" in failed["oov"]["error"] and str(V) in failed["oov"]["error"]
    assert failed["oov"]["line"] == 8 and failed[13]["line"] == 13
    assert "more than one line" in failed["r3"]["error"] and failed["r3"]["line"] == 21
    done = [r["id"] for r in read_jsonl(out)]
    assert sorted(done) == sorted(f"r{i}" for i in range(20) if i not in (7, 12))
    # Fixed input: the failed lines are retried, nothing else is redone.
    rows[7], rows[12], rows[-1] = {"id": "oov", "ids": [5]}, {"ids": [6]}, {"id": "r20", "ids": [1]}
    write_jsonl(inp, rows)
    res = run_cli(redis_url, inp, out, "--top-k", 3)
    assert res.returncode == 0 and "3 done, 18 skipped (already done), 0 failed" in res.stdout
    assert len(read_jsonl(out)) == 21
    assert not (tmp_path / "out.jsonl.errors.jsonl").exists()


def test_a_pool_slower_than_the_window_fails_no_line(
    redis_server: RedisServer, workers: Callable[..., Any], tmp_path: Path
) -> None:
    """More requests in flight than the pool answers within --timeout-s: queued behind the
    run's own others, each would wait past its timeout (3,000 full rows against one CPU worker
    failed 689 lines so). The run keeps fewer in flight and sends a timed-out line again while
    the pool answers others: no line fails for a long queue. A pool that answers nothing
    does fail them, each saying so, and the next run retries them."""
    vocab = 512  # a model of its own: the module's worker does not serve it
    w = workers(
        redis_server.url, backend="mock", mock_vocab_size=vocab, mock_delay_ms=100, max_batch=1
    )  # about 10 rows a second: 64 in flight wait 6 s, twice the timeout
    n = 100
    inp = write_jsonl(tmp_path / "in.jsonl", [{"ids": prompt(i)} for i in range(n)])
    out = tmp_path / "out.jsonl"
    args = (inp, out, "--concurrency", 64, "--timeout-s", 3)
    res = run_cli(redis_server.url, *args, model=f"mock-{vocab}")
    errors = tmp_path / "out.jsonl.errors.jsonl"
    assert res.returncode == 0, errors.read_text() if errors.exists() else res.stderr
    assert f"{n} done, 0 skipped (already done), 0 failed" in res.stdout
    assert sorted(r["id"] for r in read_jsonl(out)) == list(range(1, n + 1))
    # A pool that answers nothing (its one worker frozen): each new line fails after its one
    # wait, saying so, and the run ends.
    more = write_jsonl(tmp_path / "more.jsonl", [{"ids": prompt(i)} for i in range(n + 3)])

    async def frozen() -> ScoreStats:
        async with await RemoteLM.connect(redis_server.url, f"mock-{vocab}", 2) as lm:
            assert w.proc is not None
            w.proc.send_signal(signal.SIGSTOP)
            try:
                return await score_jsonl(lm, more, out, ScoreOptions(concurrency=64))
            finally:
                w.proc.send_signal(signal.SIGCONT)

    stats = asyncio.run(asyncio.wait_for(frozen(), 30))
    assert (stats.skipped, stats.done, stats.failed) == (n, 0, 3)
    assert all("RequestTimeout" in r["error"] for r in read_jsonl(errors))
    res = run_cli(redis_server.url, more, out, *args[2:], model=f"mock-{vocab}")
    assert res.returncode == 0 and f"3 done, {n} skipped (already done), 0 failed" in res.stdout


def test_an_unreadable_line_does_not_take_the_id_of_its_number(
    redis_url: str, tmp_path: Path
) -> None:
    """A line that is not JSON is named by its number in the errors; a line whose own id is
    that number is scored, not refused as a second line of that id."""
    inp = write_jsonl(tmp_path / "in.jsonl", ['{"ids": [1, 2', {"id": 1, "ids": [3, 4]}])
    out = tmp_path / "out.jsonl"
    res = run_cli(redis_url, inp, out, "--top-k", 3)
    assert res.returncode == 1 and "1 done, 0 skipped (already done), 1 failed" in res.stdout
    assert [r["id"] for r in read_jsonl(out)] == [1]
    (failed,) = read_jsonl(tmp_path / "out.jsonl.errors.jsonl")
    assert failed["line"] == 1 and "not JSON" in failed["error"]


def test_a_line_that_is_not_json_is_told_as_written() -> None:
    """A string cut short (``{"text": "broken``) is called unterminated: the line's own newline
    was parsed with it, and the error named an invisible "Invalid control character"."""
    from producer.scoring.inputs import LineError, read_line

    with pytest.raises(LineError) as caught:
        read_line(b'{"text": "broken\n', 11)
    said = str(caught.value)
    assert said.startswith("line 11 is not JSON: Unterminated string"), said


def test_loading_distributions_of_a_jsonl_output_says_what_it_holds(tmp_path: Path) -> None:
    """``load_logprobs`` given a top-k (sample, score) output, which has no shards: an error
    that says so and what to do (it was ``KeyError: 'shard'``)."""
    from producer.scoring.files import OutputError

    out = write_jsonl(tmp_path / "out.jsonl", [{"id": 1, "top_ids": [3], "top_logprobs": [-0.1]}])
    with pytest.raises(OutputError, match=r"out.jsonl holds no distributions .* read it as JSONL"):
        load_logprobs(out)


def test_a_file_that_is_no_output_is_left_as_it_is(redis_url: str, tmp_path: Path) -> None:
    """INPUT and OUTPUT swapped: the prompts, given as the output, are refused and keep every
    byte, their last line too (no newline after it: it was cut off as a torn line), and so is
    a one-line file without a newline."""
    prompts = tmp_path / "prompts.jsonl"
    for content in ('{"id": "a", "ids": [1, 2]}\n{"id": "b", "ids": [3, 4]}', '{"ids": [5]}'):
        prompts.write_text(content)
        results = write_jsonl(tmp_path / "results.jsonl", [{"ids": [5]}])
        for more in ((), ("--top-k", 5), ("--mode", "score")):
            res = run_cli(redis_url, results, prompts, *more)
            assert res.returncode == 2, res.stderr
            assert "lmpool-score:" in res.stderr and "Traceback" not in res.stderr
            assert prompts.read_text() == content, more


def test_a_torn_last_line_is_cut_and_scored_again(redis_url: str, tmp_path: Path) -> None:
    """A kill can leave an output's last line without its newline, cut short or (a write cut
    just before it) whole: either is taken off and its line scored again."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "ids": prompt(i)} for i in range(4)])
    out = tmp_path / "out.jsonl"
    assert run_cli(redis_url, inp, out, "--top-k", 3).returncode == 0
    whole = out.read_bytes()
    for cut in (whole[:-1], whole[:-9]):
        out.write_bytes(cut)
        res = run_cli(redis_url, inp, out, "--top-k", 3)
        assert res.returncode == 0 and "1 done, 3 skipped" in res.stdout, res.stdout
        assert out.read_bytes() == whole


def test_an_input_read_once_is_refused(redis_url: str, tmp_path: Path) -> None:
    """A pipe is read once: counted, it would score nothing and exit 0 (a named pipe blocked
    for good). It is refused at start, the output untouched."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"ids": prompt(i)} for i in range(5)])
    out = tmp_path / "out.jsonl"
    res = subprocess.run(
        cli(redis_url, "/dev/stdin", out), input=src.read_text(), cwd=REPO, env=env(),
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    named = run_cli(redis_url, fifo, tmp_path / "out2.jsonl")
    for r in (res, named):
        assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    assert not out.exists()
    missing = run_cli(redis_url, tmp_path / "nowhere.jsonl", out)
    assert missing.returncode == 2 and "no input file" in missing.stderr


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [("--max-tokens", 2_000_000, "max_tokens"), ("--seed", 2**70, "seed")],
)
def test_a_setting_no_request_can_have_is_refused_at_start(
    redis_url: str, tmp_path: Path, flag: str, value: int, said: str
) -> None:
    """Not every line sent and failed alone: the run stops at once, as ``--max-tokens 0``."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"ids": prompt(i)} for i in range(5)])
    res = run_cli(redis_url, inp, tmp_path / "out.jsonl", "--mode", "sample", flag, value)
    assert res.returncode == 2 and said in res.stderr, res.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_continuation_text_is_scored_without_the_prompts_special_tokens() -> None:
    """A tokenizer that puts BOS before every text (Llama, Mistral, Gemma): the prompt's text
    gets it, the continuation's does not (its scores would start with log p(BOS | prompt))."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from producer.scoring.inputs import make_item
    from producer.scoring.options import ScoreOptions

    vocab = {chr(c): c - 97 for c in range(97, 123)} | {"<s>": 26}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 26)]
    )
    bos = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
    line = {"text": "ab", "continuation_text": "cd"}
    item = make_item(line, "x", 1, ScoreOptions(mode="score"), bos)
    assert item.prompt == [26, 0, 1]
    assert item.continuation == [2, 3]


@pytest.mark.asyncio
async def test_arq_job_scores_the_file_and_reports_progress(redis_url: str, tmp_path: Path) -> None:
    from arq import create_pool
    from arq.connections import RedisSettings
    from arq.jobs import Job

    from producer.scoring.job import pack_job, unpack_job

    n = 200
    inp = write_jsonl(tmp_path / "in.jsonl", [{"ids": prompt(i)} for i in range(n)])
    out = tmp_path / "out.jsonl"
    job_id = await enqueue_score_file(redis_url, inp, out, mode="logprobs", top_k=4)
    arq = await create_pool(
        RedisSettings.from_dsn(redis_url),
        job_serializer=pack_job,
        job_deserializer=unpack_job,
        default_queue_name=Keys().arq_queue,
    )
    try:
        job = Job(job_id, arq, _queue_name=Keys().arq_queue, _deserializer=unpack_job)
        result = await job.result(timeout=60, poll_delay=0.1)
    finally:
        await arq.aclose()
    assert result["total"] == result["done"] == result["completed"] == n
    assert result["failed"] == 0 and result["output"] == str(out)
    progress = await read_job_progress(redis_url, job_id)
    assert progress["state"] == "finished"
    assert progress["done"] == progress["total"] == str(n) and progress["failed"] == "0"
    assert float(progress["updated_at"]) > time.time() - 60 and float(progress["rate"]) > 0
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == list(range(1, n + 1))
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        for r in records[:20]:
            values, top = torch.topk(await lm.next_token_logprobs(prompt(r["id"] - 1)), 4)
            assert r["top_ids"] == top.tolist()
            assert torch.equal(torch.tensor(r["top_logprobs"]), values)
