"""The whole request path with the mock backend: real worker processes on a real Redis, each
test run on a single server and on a Redis Cluster (3 masters, 3 replicas)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
from poolkit import mock_row, redis_connections

from producer import RemoteLM
from shared.errors import (
    InvalidRequest,
    LMPoolError,
    NoWorker,
    PoolUnreachable,
    RequestTimeout,
    SettingsError,
)
from shared.keys import Keys
from shared.redis_conn import connect_redis_sync
from worker.stream.batcher import Job
from worker.stream.writer import finish_groups

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(180)


def reference(ids: list[int], vocab: int = V) -> torch.Tensor:
    return mock_row(vocab, ids)


@pytest.fixture
def mock_worker(any_redis_url: str, workers: Callable[..., Any]) -> Any:
    return workers(any_redis_url, backend="mock", mock_vocab_size=V)


@pytest.mark.asyncio
async def test_logprobs_equal_in_process_backend(any_redis_url: str, mock_worker: Any) -> None:
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        got = await lm.next_token_logprobs([1, 2, 3])
        assert got.shape == (V,)
        assert torch.equal(got, reference([1, 2, 3]))
        assert torch.allclose(got.exp().sum(), torch.tensor(1.0), atol=1e-5)
        batch = await lm.batch_next_token_logprobs([[4], [5, 6], torch.tensor([7, 8, 9])])
        assert batch.shape == (3, V)
        for row, ids in zip(batch, [[4], [5, 6], [7, 8, 9]], strict=True):
            assert torch.equal(row, reference(ids))


@pytest.mark.asyncio
async def test_sync_forms_with_a_running_loop(any_redis_url: str, mock_worker: Any) -> None:
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        one = lm.next_token_logprobs_sync([10, 11])
        many = lm.batch_next_token_logprobs_sync([[10, 11], [12]])
        assert torch.equal(one, reference([10, 11]))
        assert torch.equal(many[1], reference([12]))
        # The async path agrees and is served from the local cache afterwards.
        assert torch.equal(await lm.next_token_logprobs([12]), many[1])


@pytest.mark.asyncio
async def test_producer_needs_no_model_files(any_redis_url: str, mock_worker: Any) -> None:
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        assert lm.tokenizer.encode("hé") == [104, 195, 169]
        assert lm.tokenizer.eos_token_id == V - 1
        assert lm.eos_token_ids == [V - 1]
        assert len(lm.byte_vocab) == V
        assert lm.byte_vocab[104] == b"h" and lm.byte_vocab[104].token_id == 104
        assert lm.str_vocab[65] == "A"


@pytest.mark.asyncio
async def test_bad_input_is_a_clear_error_and_the_worker_carries_on(
    any_redis_url: str, mock_worker: Any
) -> None:
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        bad_prompts: list[Any] = [[], [V], [-1], [1.5], ["a"], [True]]  # mistyped on purpose
        for bad in bad_prompts:
            with pytest.raises(InvalidRequest):
                await lm.next_token_logprobs(bad)
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'nope'"):
            await lm.next_token_logprobs([1], lora_name="nope")
        with pytest.raises(InvalidRequest, match="temperature"):
            await lm.sample([1], 3, [V - 1], temperature=-1.0)
        assert torch.equal(await lm.next_token_logprobs([1]), reference([1]))


@pytest.mark.asyncio
async def test_bad_input_errors_say_what_is_wrong_and_how_to_fix_it(
    any_redis_url: str, mock_worker: Any
) -> None:
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        with pytest.raises(InvalidRequest, match=r"^empty continuation: "):
            await lm.score([1, 2], [])
        with pytest.raises(InvalidRequest, match=r"^empty prompt: "):
            await lm.score([], [1])
        text: Any = "The capital of France is"  # text where token ids belong
        hint = r"tokenize text first, e\.g\. lm\.tokenizer\.encode\(text\)$"
        with pytest.raises(InvalidRequest, match=r"prompt token ids must be integers.*" + hint):
            await lm.next_token_logprobs(text)
        with pytest.raises(InvalidRequest, match="continuation token ids .*" + hint):
            await lm.score([1], text)
        with pytest.raises(InvalidRequest, match="token id 'a' is not an integer.*" + hint):
            await lm.next_token_logprobs(cast(Any, list("abc")))
        with pytest.raises(
            InvalidRequest,
            match=r"^prompt token ids must be a sequence, not int 5: one token is \[5\]$",
        ):
            await lm.next_token_logprobs(cast(Any, 5))
        with pytest.raises(
            InvalidRequest, match=r"^prompt token ids must be a sequence, not NoneType None$"
        ):
            await lm.next_token_logprobs(cast(Any, None))
        with pytest.raises(
            InvalidRequest,
            match=r"^prompt token ids must be one flat sequence, not of shape \(1, 2\)$",
        ):
            await lm.next_token_logprobs(cast(Any, [[1, 2]]))
        with pytest.raises(InvalidRequest, match="eos_token_ids"):
            await lm.sample([1], 3, eos_token_ids=cast(Any, "</s>"))
        # the class name is not repeated in the message
        with pytest.raises(InvalidRequest) as caught:
            await lm.sample([1], 3, [V - 1], temperature=-1.0)
        assert str(caught.value) == "temperature must be >= 0 (0: greedy), got -1.0"
        with pytest.raises(InvalidRequest, match=r"^temperature must be >= 0 .*got nan$"):
            await lm.sample([1], 3, [V - 1], temperature=float("nan"))
        with pytest.raises(InvalidRequest, match=r"^seed must be an int of 64 bits at most"):
            await lm.sample([1], 3, [V - 1], seed=2**70)  # msgpack's OverflowError before
        # numpy makes floats of a uint64 beside an int: still integers ("5.0" refused before)
        got = await lm.next_token_logprobs(cast(Any, [np.uint64(5), 6]))
        assert torch.equal(got, mock_row(V, [5, 6]))
        huge = r"^prompt token id 1180591620717411303424 is not an integer in \[0, 300\)$"
        with pytest.raises(InvalidRequest, match=huge):
            await lm.next_token_logprobs([1, 2**70])  # "token id 1" before
        # no prompts: no rows, in either form
        assert (await lm.batch_next_token_logprobs([])).shape == (0, V)
        assert lm.batch_next_token_logprobs_sync([]).shape == (0, V)


@pytest.mark.asyncio
async def test_sampling_is_seeded_and_scoring_matches_logprobs(
    any_redis_url: str, mock_worker: Any
) -> None:
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        a = await lm.sample([1, 2], 20, [V - 1], seed=7)
        lm.clear_cache()
        b = await lm.sample([1, 2], 20, [V - 1], seed=7)
        assert a == b and 0 < len(a) <= 20 and V - 1 not in a
        many = await lm.batch_sample([[1, 2], [3]], 5, [V - 1], seed=7)
        assert many[0] == a[:5]
        scores = await lm.score([1, 2], [3, 4])
        expect = torch.stack([reference([1, 2])[3], reference([1, 2, 3])[4]])
        assert torch.allclose(scores, expect, atol=1e-6)


@pytest.mark.asyncio
async def test_batch_sample_without_a_seed_draws_each_prompt_anew(
    any_redis_url: str, mock_worker: Any
) -> None:
    """The same prompt four times: four independent draws without a seed (as four ``sample``
    calls), four equal ones with a seed, each equal to ``sample`` with that seed."""
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        free = await lm.batch_sample([[7, 8, 9]] * 4, 12, [V - 1])
        assert len({tuple(d) for d in free}) == 4, free
        seeded = await lm.batch_sample([[7, 8, 9]] * 4, 12, [V - 1], seed=3)
        assert seeded == [await lm.sample([7, 8, 9], 12, [V - 1], seed=3)] * 4


def test_cache_kv_not_awaited_runs_to_its_end_past_its_loop(
    any_redis_url: str, mock_worker: Any
) -> None:
    """genlm-style ``lm.cache_kv(prefix)`` inside a coroutine, never awaited, in a loop that
    ends at once (``asyncio.run``): the pin still reaches the worker and answers (the mock has
    no KV cache: False), and so does ``clear_kv_cache``; nothing is cancelled."""
    lm = RemoteLM.from_name(MODEL, redis_url=any_redis_url)
    try:

        async def hint() -> Any:
            return lm.cache_kv([1, 2, 3]), lm.clear_kv_cache()

        pinned, cleared = asyncio.run(hint())
        for future in (pinned, cleared):
            assert future.done() and not future.cancelled()
        assert pinned.result() is False and cleared.result() is None
        assert lm.cache_kv([1, 2, 3]) is False  # the blocking form, the same answer
    finally:
        lm.cleanup()


@pytest.mark.asyncio
async def test_connect_without_worker_names_the_model(any_redis_url: str) -> None:
    with pytest.raises(NoWorker, match="mock-300"):
        await RemoteLM.connect(any_redis_url, model=MODEL, connect_timeout_s=0.3)


@pytest.mark.asyncio
async def test_a_connect_still_waiting_says_why_once_long_before_its_timeout(
    any_redis_url: str, mock_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A misspelled model name: one warning after ~1 s naming the models the pool has served
    (asyncio and blocking), then ``NoWorker`` at the timeout; a connect that finds its worker
    says nothing."""
    caplog.set_level("WARNING", logger="lmpool.producer")
    async with await RemoteLM.connect(any_redis_url, model=MODEL):
        pass
    assert not caplog.records, "no warning when the worker is there"
    for blocking in (False, True):
        caplog.clear()
        t0, t0_wall = time.monotonic(), time.time()
        with pytest.raises(NoWorker, match="mock-3OO"):
            if blocking:
                RemoteLM.from_name("mock-3OO", redis_url=any_redis_url, connect_timeout_s=2.5)
            else:
                await RemoteLM.connect(any_redis_url, model="mock-3OO", connect_timeout_s=2.5)
        assert time.monotonic() - t0 >= 2.5
        (record,) = caplog.records
        message = record.getMessage()
        assert record.levelname == "WARNING"
        assert "no worker has served model 'mock-3OO'" in message, message
        assert f"models there: ['{MODEL}']" in message and "waiting up to 2.5s" in message
        assert 0.9 <= record.created - t0_wall < 2.0, "said after about a second, once"


@pytest.mark.asyncio
async def test_connect_to_a_redis_that_does_not_answer_says_so_naming_the_url(
    redis_url: str,
) -> None:
    """Refused (nothing listens) and refused credentials: ``PoolUnreachable`` (an lmpool error
    and a ``ConnectionError``) at once, naming the URL with its password masked, in asyncio
    and blocking use."""
    from localpool.redis_server import free_port

    port = cast(int, urlparse(redis_url).port)
    cases = [
        (f"redis://127.0.0.1:{free_port()}/0", "Error 111"),
        (f"redis://nobody:s3cret@127.0.0.1:{port}/0", "redis://nobody:***@127.0.0.1"),
    ]
    for url, says in cases:
        for blocking in (False, True):
            t0 = time.monotonic()
            with pytest.raises(PoolUnreachable) as caught:
                if blocking:
                    RemoteLM.from_name(MODEL, redis_url=url, connect_timeout_s=30)
                else:
                    await RemoteLM.connect(url, model=MODEL, connect_timeout_s=30)
            message = str(caught.value)
            assert isinstance(caught.value, LMPoolError) and isinstance(
                caught.value, ConnectionError
            )
            assert message.startswith("cannot reach the pool's Redis at redis://"), message
            assert says in message and "LMPOOL_REDIS_URL" in message, message
            assert "s3cret" not in message
            assert time.monotonic() - t0 < 5.0, "refused at once, not after connect_timeout_s"


@pytest.mark.asyncio
async def test_timeout_when_the_worker_is_gone_names_queue_state(
    any_redis_url: str, mock_worker: Any
) -> None:
    lm = await RemoteLM.connect(any_redis_url, model=MODEL, timeout_s=1.0)
    mock_worker.kill()
    with pytest.raises(RequestTimeout, match=r"mock-300.*within 1s.*interactive queue 1"):
        await lm.next_token_logprobs([42, 43])
    await lm.close()


@pytest.mark.asyncio
async def test_a_close_while_a_timeout_asks_the_queue_state_still_tells_the_caller(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A request times out while Redis is slow (paused 0.6 s): the producer asks the queue
    state for the message, and the client closes meanwhile. The caller gets its
    ``RequestTimeout`` (before, the close cancelled the asking and the caller waited forever)."""
    mock_worker = workers(redis_url, backend="mock", mock_vocab_size=V)
    lm = await RemoteLM.connect(redis_url, model=MODEL, timeout_s=1.0)
    mock_worker.kill()
    call = asyncio.create_task(lm.next_token_logprobs([5, 6, 7]))
    await asyncio.sleep(0.95)
    r = connect_redis_sync(redis_url)
    r.execute_command("CLIENT", "PAUSE", 600, "ALL")
    await asyncio.sleep(0.3)  # past the deadline: the queue state is being asked
    await lm.close()
    with pytest.raises(RequestTimeout, match="within 1s"):
        await asyncio.wait_for(call, 5)
    r.close()


@pytest.mark.asyncio
async def test_a_request_asked_again_as_the_last_one_times_out_stays_registered(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A times out while Redis is slow (paused 0.7 s) and B asks for the same prompt meanwhile:
    A's leaving (SREM of this loop's reply list from the digest's waiter set, sent once the
    pause ends) does not undo B's registration, so a worker started later answers B (before,
    the worker skipped it as unwaited for, and B timed out)."""
    mock_worker = workers(redis_url, backend="mock", mock_vocab_size=V)
    lm = await RemoteLM.connect(redis_url, model=MODEL, timeout_s=1.5)
    mock_worker.kill()
    r = connect_redis_sync(redis_url)
    a = asyncio.create_task(lm.next_token_logprobs([21, 22, 23]))
    await asyncio.sleep(1.4)
    r.execute_command("CLIENT", "PAUSE", 700, "ALL")
    await asyncio.sleep(0.25)  # A's deadline passed: the queue state is being asked
    lm.timeout_s = 12.0  # B waits longer
    b = asyncio.create_task(lm.next_token_logprobs([21, 22, 23]))
    with pytest.raises(RequestTimeout):
        await a
    await asyncio.sleep(0.5)
    workers(redis_url, backend="mock", mock_vocab_size=V)
    assert torch.equal(await asyncio.wait_for(b, 10), mock_row(V, [21, 22, 23]))
    await lm.close()
    r.close()


def test_a_blocking_timeout_names_the_queue_state_too(any_redis_url: str, mock_worker: Any) -> None:
    """The blocking path (one request, and a batch) says what the async path says."""
    lm = asyncio.run(RemoteLM.connect(any_redis_url, model=MODEL, timeout_s=1.0))
    mock_worker.kill()
    state = r"\(0 live worker\(s\), interactive queue {n} \(0 pending\), offline queue 0"
    with pytest.raises(RequestTimeout, match=r"mock-300.*within 1s " + state.format(n=1)):
        lm.next_token_logprobs_sync([42, 43])
    # [42, 43] again: the timed-out call left its waiter set, so it is queued anew (4 entries)
    with pytest.raises(RequestTimeout, match=r"within 1s " + state.format(n=4)):
        lm.batch_next_token_logprobs_sync([[42, 43], [44], [45]])
    asyncio.run(lm.close())


@pytest.mark.asyncio
async def test_two_workers_two_producers_many_requests_each_computed_once(
    any_redis_url: str, workers: Callable[..., Any]
) -> None:
    pool = [workers(any_redis_url, backend="mock", mock_vocab_size=V) for _ in range(2)]
    while not all(len(w.info().get("shards", [])) == 2 for w in pool):
        await asyncio.sleep(0.05)  # leases settle: each worker owns two of the four shards
    distinct = [[i % 250, i // 250, 7] for i in range(240)]
    lms = [await RemoteLM.connect(any_redis_url, model=MODEL) for _ in range(2)]
    # Each producer asks every distinct prompt, some twice, all at once.
    asks = [(lm, ids) for lm in lms for ids in distinct + distinct[:40]]
    results = await asyncio.gather(*(lm.next_token_logprobs(ids) for lm, ids in asks))
    for (_, ids), got in zip(asks, results, strict=True):
        assert torch.equal(got, reference(ids))
    rows = [await w.wait_counter("rows", 1) for w in pool]
    await asyncio.sleep(0.5)  # two more heartbeats: the counters are final
    rows = [int(w.info()["rows"]) for w in pool]
    assert sum(rows) == len(distinct), rows
    assert all(r > 0 for r in rows), f"both workers should share the load: {rows}"
    for lm in lms:
        await lm.close()


@pytest.mark.asyncio
async def test_shared_cache_serves_a_second_producer_without_the_queue(
    any_redis_url: str, mock_worker: Any
) -> None:
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as a:
        first = await a.next_token_logprobs([9, 9, 9])
    assert await mock_worker.wait_counter("requests", 1) == 1
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as b:
        assert torch.equal(await b.next_token_logprobs([9, 9, 9]), first)
        await b.next_token_logprobs([9, 9])  # a new prompt: the worker sees exactly this one
    assert await mock_worker.wait_counter("requests", 2) == 2
    await asyncio.sleep(0.5)
    assert mock_worker.info()["requests"] == 2
    r = connect_redis_sync(any_redis_url)
    assert len(list(r.scan_iter(Keys().results(MODEL)))) == 2
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as c:
        assert await c.clear_shared_cache() == 2
        assert not list(r.scan_iter(Keys().results(MODEL)))
        assert torch.equal(await c.next_token_logprobs([9, 9]), reference([9, 9]))
    assert await mock_worker.wait_counter("requests", 3) == 3  # computed again
    r.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("max_wait_ms", [0, 2000])
async def test_a_partly_filled_batch_waits_max_wait_ms_for_company(
    any_redis_url: str, workers: Callable[..., Any], max_wait_ms: int
) -> None:
    """LMPOOL_MAX_WAIT_MS: four requests sent 50 ms apart to an idle worker (max_batch 4) run
    as one batch when it may wait for company, not all together when it may not."""
    w = workers(
        any_redis_url, backend="mock", mock_vocab_size=V, max_batch=4, max_wait_ms=max_wait_ms
    )
    async with await RemoteLM.connect(any_redis_url, model=MODEL) as lm:
        tasks = []
        for i in range(4):
            tasks.append(asyncio.create_task(lm.next_token_logprobs([40, i])))
            await asyncio.sleep(0.05)
        rows = await asyncio.gather(*tasks)
    for i, row in enumerate(rows):
        assert torch.equal(row, reference([40, i]))
    assert await w.wait_counter("requests", 4) == 4
    batches = await w.wait_counter("batches", 1)
    if max_wait_ms:
        assert batches == 1
    else:  # each runs when read (on a cluster, a shard read late may bring two together)
        assert batches > 1


def test_finish_groups_close_after_a_megabyte_of_results() -> None:
    row, small = bytes(196_608), bytes(1_200)
    jobs = [Job(f"d{i}", 0, [], result=row) for i in range(13)]
    groups = finish_groups(jobs)
    assert [len(g) for g in groups] == [6, 6, 1]  # a group closes once it holds >= 1 MiB
    assert [i for g in groups for i in g] == list(range(13))  # every job once, in order
    assert finish_groups([Job(f"s{i}", 0, [], result=small) for i in range(500)]) == [
        list(range(500))
    ]
    errors = [Job(f"e{i}", 0, []) for i in range(3)]  # no result: errors, cache hits
    assert finish_groups(errors) == [[0, 1, 2]]


@pytest.mark.asyncio
async def test_full_rows_written_in_several_finish_groups_all_reach_their_askers(
    any_redis_url: str, workers: Callable[..., Any]
) -> None:
    """Rows of SmolLM2's vocabulary (196 KB each) go out in groups of about 1 MB, each with
    its own FINISH: every asker gets its own row, on a single Redis (replies pushed by FINISH)
    and on a cluster (replies pushed by a second pipeline, FINISH by FINISH)."""
    vocab = 49152
    w = workers(any_redis_url, backend="mock", mock_vocab_size=vocab, max_batch=32)
    prompts = [[7, 8, i] for i in range(20)]
    assert len(finish_groups([Job("d", 0, [], result=bytes(4 * vocab))] * 20)) > 3
    async with await RemoteLM.connect(any_redis_url, model=f"mock-{vocab}") as lm:
        rows = await lm.batch_next_token_logprobs(prompts)
    for ids, row in zip(prompts, rows, strict=True):
        assert torch.equal(row, reference(ids, vocab))
    assert await w.wait_counter("requests", 20) == 20


@pytest.mark.asyncio
async def test_requests_submitted_together_run_as_one_batch(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """An SMC step's 64 particles, submitted together, run in one forward pass every step,
    though interactive requests came recently and offline work would then be read 4 at a time
    (LMPOOL_OFFLINE_BATCH; that they come in one read: ``tests/test_reader.py``)."""
    w = workers(redis_url, backend="mock", mock_vocab_size=V, max_batch=64)
    rounds, shared = 3, list(range(1, 33))  # one shard: the first 32 tokens are shared
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        for r in range(rounds):
            # the client's own work between steps (drawing tokens), longer than the worker's
            # grace for offline work after an interactive step (5 ms)
            await asyncio.sleep(0.05)
            prompts = [[*shared, r, i] for i in range(64)]
            rows = await lm.batch_next_token_logprobs(prompts)
            assert torch.equal(rows[5], reference(prompts[5]))
    assert await w.wait_counter("requests", 64 * rounds) == 64 * rounds
    assert await w.wait_counter("batches", rounds) == rounds


@pytest.mark.asyncio
async def test_a_stop_ends_the_wait_for_company(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A worker waiting up to 20 s for company for a lone request answers it and exits soon
    after SIGTERM, not after the wait."""
    w = workers(redis_url, backend="mock", mock_vocab_size=V, max_batch=4, max_wait_ms=20_000)
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=30) as lm:
        request = asyncio.create_task(lm.next_token_logprobs([41, 1]))
        await asyncio.sleep(1.0)
        assert not request.done()  # held for company
        started = asyncio.get_running_loop().time()
        code = await asyncio.to_thread(w.terminate, 15)
        row = await asyncio.wait_for(request, 10)
        assert asyncio.get_running_loop().time() - started < 10
    assert code == 0
    assert torch.equal(row, reference([41, 1]))


@pytest.mark.asyncio
async def test_one_request_at_a_time_costs_the_worker_one_read_each(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """With one request in flight the worker reads its streams about once per request: not
    again while the request's step runs (its read found them drained; what arrives meanwhile is read
    when the step ends)."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    r = connect_redis_sync(redis_url)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        await lm.next_token_logprobs([50])
        r.config_resetstat()
        n = 60
        for i in range(n):
            assert torch.equal(await lm.next_token_logprobs([50, i]), reference([50, i]))
        stats: Any = r.info("commandstats")
    r.close()
    reads = stats["cmdstat_xreadgroup"]["calls"]
    # one each; after every fourth step two more (a look at the own shards, then at the offline
    # streams: their guaranteed share); before the change about 2.1 per request
    assert n <= reads < 1.75 * n


@pytest.mark.asyncio
@pytest.mark.parametrize("blocking", [False, True], ids=["async", "blocking"])
async def test_a_lone_request_gets_its_result_in_the_round_trip_that_submits_it(
    redis_url: str, workers: Callable[..., Any], listen_block_s: float, blocking: bool
) -> None:
    """One request in flight: SUBMIT (as EVAL), the pop of its reply and the GET of its result
    leave in one pipeline, so the result (8 KB here, too large to ride inside the reply) comes
    back with the reply: every SUBMIT is an EVAL (the pipeline's form) and every reply is
    popped by its own pipeline, the listener popping nothing. A result already in the shared
    cache ends the pop at once (SUBMIT pushes a marker)."""
    big = 2048
    workers(redis_url, backend="mock", mock_vocab_size=big)
    r = connect_redis_sync(redis_url)
    async with await RemoteLM.connect(redis_url, model=f"mock-{big}", cache_size=0) as lm:

        async def ask(ids: list[int]) -> torch.Tensor:
            return (
                lm.next_token_logprobs_sync(ids) if blocking else await lm.next_token_logprobs(ids)
            )

        await ask([60])
        r.config_resetstat()
        n = 20
        for i in range(n):
            assert torch.equal(await ask([60, i]), reference([60, i], big))
        started = time.monotonic()
        assert torch.equal(await ask([60, 0]), reference([60, 0], big))
        hit_s = time.monotonic() - started
        stats: Any = r.info("commandstats")
    r.close()
    calls = {c: stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("eval", "blmpop")}
    assert calls == {"eval": n + 1, "blmpop": n + 1}
    assert hit_s < listen_block_s / 2, "the pop of a cache hit waited for a reply"


def test_sync_use_without_an_event_loop(any_redis_url: str, mock_worker: Any) -> None:
    """A plain script: connect with asyncio.run, then only blocking calls."""
    lm = asyncio.run(RemoteLM.connect(any_redis_url, model=MODEL))
    assert torch.equal(lm.next_token_logprobs_sync([1, 2]), reference([1, 2]))
    rows = lm.batch_next_token_logprobs_sync([[3], [4, 5], [3]])
    assert torch.equal(rows[2], reference([3])) and torch.equal(rows[1], reference([4, 5]))
    with pytest.raises(InvalidRequest):
        lm.next_token_logprobs_sync([V + 1])
    asyncio.run(lm.close())


@pytest.mark.parametrize("how", ["close", "cleanup"])
@pytest.mark.asyncio
async def test_close_from_another_loop_fails_that_loops_flood_at_once(
    redis_url: str, workers: Callable[..., Any], how: str
) -> None:
    """A thread's own loop has 1,000 requests out (~0.5 s of work) when this loop closes the
    object (``close``; or ``cleanup`` from a thread with no loop): it returns at once, every
    request still out fails with "closed", the thread's ``asyncio.run`` ends, and nothing is
    left behind for good: no socket open, no reply list without an expiry (that loop may end
    while the close is still ending its state there)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, max_batch=16, mock_delay_ms=8)
    port = urlparse(redis_url).port or 6379
    r = connect_redis_sync(redis_url)
    r.ping()
    sockets_before = redis_connections(port)  # r's own among them
    lm = await RemoteLM.connect(redis_url, model=MODEL, cache_size=0)
    await lm.next_token_logprobs([7])
    outcomes: list[str] = []

    async def flood() -> None:
        async def one(i: int) -> None:
            try:
                ids = [1 + i % 250, 1 + i // 250, 9]
                assert torch.equal(await lm.next_token_logprobs(ids), reference(ids))
                outcomes.append("answered")
            except Exception as e:
                outcomes.append(str(e))

        await asyncio.gather(*(one(i) for i in range(1000)))

    thread = threading.Thread(target=asyncio.run, args=(flood(),))
    thread.start()
    await asyncio.sleep(0.3)
    started = time.monotonic()
    if how == "close":
        await lm.close()
    else:
        await asyncio.to_thread(lm.cleanup)
    closed_s = time.monotonic() - started
    await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive(), "the thread's loop still waits on a closed RemoteLM"
    assert closed_s < 1.0, f"close took {closed_s:.2f} s"
    failed = [o for o in outcomes if o != "answered"]
    assert len(outcomes) == 1000 and failed, f"{len(failed)} of {len(outcomes)} failed"
    assert set(failed) == {"this RemoteLM is closed"}, set(failed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()  # an unclosed transport warns as it is collected
    assert not [w for w in caught if w.category is ResourceWarning], [str(w) for w in caught]
    assert redis_connections(port) == sockets_before, "sockets left open"
    # a SUBMIT sent before the close may add a reply list to a waiter set after it left them
    # all; a worker's answer then makes the list anew, with its expiry: nothing stays for good
    left = {key: r.pttl(key) for key in r.scan_iter(Keys().reply("*"))}
    assert all(ttl > 0 for ttl in left.values()), f"reply lists left without expiry: {left}"
    r.close()


@pytest.mark.parametrize("how", ["cleanup", "close"])
def test_closing_ends_the_state_of_a_loop_that_is_not_running(
    redis_url: str, workers: Callable[..., Any], how: str
) -> None:
    """A loop driven by ``run_until_complete`` is idle between calls: ``cleanup()`` (or a
    ``close()`` from another loop) ends its state the next time it runs, so its listener and
    housekeeping tasks stop and its sockets close (before, that loop's state was forgotten,
    not ended: both tasks ran on and 4 connections stayed open for good)."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    port = urlparse(redis_url).port or 6379
    r = connect_redis_sync(redis_url)
    r.ping()
    sockets_before = redis_connections(port)
    lm = RemoteLM.from_name(MODEL, redis_url=redis_url, timeout_s=10.0)
    loop = asyncio.new_event_loop()
    try:
        row = loop.run_until_complete(lm.next_token_logprobs([1, 2, 3]))
        assert torch.equal(row, reference([1, 2, 3]))
        if how == "cleanup":
            lm.cleanup()
        else:
            asyncio.run(lm.close())
        loop.run_until_complete(asyncio.sleep(0.3))
        alive = [t.get_name() for t in asyncio.all_tasks(loop) if not t.done()]
        assert alive == [], alive
        assert redis_connections(port) == sockets_before, "sockets left open"
    finally:
        loop.close()
        r.close()


def test_backend_auto_selection() -> None:
    from shared.settings import Settings
    from worker.backends import choose_backend

    assert choose_backend(Settings(backend="mock")) == "mock"
    assert choose_backend(Settings(backend="sglang")) == "sglang"
    # no CUDA on this machine: auto is hf (vllm needs CUDA and vLLM)
    assert not torch.cuda.is_available()
    assert choose_backend(Settings()) == "hf"


def test_the_blocking_clients_of_ended_loops_and_threads_are_closed(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """``cache_kv`` and ``release_all`` run in a loop's executor threads, each with a blocking
    client: ten ``asyncio.run`` rounds left ten connections open until ``close()``, and so did
    ten threads that made one blocking call each (an SMC script ran out of descriptors)."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    port = cast(int, urlparse(redis_url).port)
    lm = RemoteLM.from_name(MODEL, redis_url=redis_url, timeout_s=10)

    async def one_run(i: int) -> None:
        await lm.cache_kv([1, 2, 3, i])
        await lm.next_token_logprobs([1, 2, 3, i, 4])
        await lm.release_all()

    asyncio.run(one_run(0))
    before = redis_connections(port)
    for i in range(1, 11):
        asyncio.run(one_run(i))
    for i in range(10):
        t = threading.Thread(target=lm.next_token_logprobs_sync, args=([5, i],))
        t.start()
        t.join()
    deadline = time.monotonic() + 5
    while redis_connections(port) > before + 1 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert redis_connections(port) <= before + 1
    lm.cleanup()


def test_cleanup_as_a_loops_last_step_closes_every_connection(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """``with lm:`` ending an async main: the close it schedules is cancelled by the loop's
    end, and the blocking client it had already taken off the object stayed open for good."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    port = cast(int, urlparse(redis_url).port)
    before = redis_connections(port)

    async def main() -> None:
        with RemoteLM.from_name(MODEL, redis_url=redis_url, timeout_s=10) as lm:
            lm.next_token_logprobs_sync([1, 2])
            await lm.next_token_logprobs([1, 2, 3])

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while redis_connections(port) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert redis_connections(port) == before


def test_a_blocking_request_right_after_add_new_lora_in_a_loop_waits_for_it(
    redis_url: str, workers: Callable[..., Any], tmp_path: Any
) -> None:
    """In a notebook (a running loop) ``add_new_lora`` then a ``*_sync`` request naming the
    adapter, as with genlm-backend: the request waits for the upload (UnknownAdapter before:
    the upload was a task that could not run while the request blocked the loop)."""
    from poolkit import build_adapter

    workers(redis_url, backend="mock", mock_vocab_size=V)
    adapter = build_adapter(tmp_path / "adapter")
    lm = RemoteLM.from_name(MODEL, redis_url=redis_url, timeout_s=10)

    async def cell() -> Any:
        added = lm.add_new_lora(str(adapter), "style")
        row = lm.next_token_logprobs_sync([1, 2], lora_name="style")
        assert (await added).startswith("style@")
        return row

    assert tuple(asyncio.run(cell()).shape) == (V,)
    lm.cleanup()


@pytest.mark.asyncio
async def test_a_wrong_argument_is_named_as_the_argument_not_the_variable(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL passed to ``connect`` that is no Redis URL is named as the argument it was (with
    its password masked), not as ``LMPOOL_REDIS_URL``, which may be unset or right; and a
    valid argument wins over a wrong ``LMPOOL_REDIS_URL``."""
    for blocking in (False, True):
        with pytest.raises(SettingsError) as caught:
            if blocking:
                RemoteLM.from_name(MODEL, redis_url="http://u:s3cret@127.0.0.1:6379/0")
            else:
                await RemoteLM.connect("http://u:s3cret@127.0.0.1:6379/0", model=MODEL)
        message = str(caught.value)
        assert message.startswith("redis_url (the argument given: http://u:***@127.0.0.1"), message
        assert "must start with redis://" in message and "s3cret" not in message, message
        with pytest.raises(SettingsError, match=r"^timeout_s \(the argument given: -1\.0\)"):
            if blocking:
                RemoteLM.from_name(MODEL, redis_url=redis_url, timeout_s=-1.0)
            else:
                await RemoteLM.connect(redis_url, model=MODEL, timeout_s=-1.0)
    monkeypatch.setenv("LMPOOL_REDIS_URL", "http://wrong")
    with pytest.raises(NoWorker):  # the argument's Redis was reached: no worker of MODEL there
        await RemoteLM.connect(redis_url, model=MODEL, connect_timeout_s=0.2)


@pytest.mark.asyncio
async def test_offline_work_gets_its_share_while_interactive_callers_keep_the_worker_busy(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Sixteen interactive callers, each asking again as soon as it has its answer, keep one
    worker's look-ahead full; offline requests sent meanwhile are answered all the same, in
    the steps their guaranteed share gives them (before: none of them, however long the flood
    lasted, as long as interactive work waited: a batch job behind an SMC run timed out)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=20, max_batch=4)
    answered = 0
    flooding = True

    async def caller(k: int, lm: RemoteLM) -> None:
        nonlocal answered
        i = 0
        while flooding:
            await lm.next_token_logprobs([k, i, 1, 2])
            answered, i = answered + 1, i + 1

    async with (
        await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm,
        await RemoteLM.connect(redis_url, model=MODEL, priority="low", timeout_s=60) as offline,
    ):
        callers = [asyncio.ensure_future(caller(k, lm)) for k in range(16)]
        try:
            while answered < 64:  # the flood is on
                await asyncio.sleep(0.02)
            prompts = [[i, 9, 9] for i in range(8)]
            rows = await asyncio.wait_for(offline.batch_next_token_logprobs(prompts), 15)
            assert flooding and not any(c.done() for c in callers)
        finally:
            flooding = False
            await asyncio.gather(*callers)
    for row, ids in zip(rows, prompts, strict=True):
        assert torch.equal(row, reference(ids))


@pytest.mark.asyncio
async def test_a_request_dropped_on_its_own_deadline_is_told_as_a_timeout(
    redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker drops a request whose deadline passed before it ran (``Expired``). Where that
    deadline is the asker's own, the asker gets the ``RequestTimeout`` every timeout gives, with
    the model and the queue's state (before: a bare ``Expired: dropped unrun: its deadline
    passed 2 ms ago`` whenever the worker's answer came before the producer's own check)."""
    import producer.loop

    monkeypatch.setattr(producer.loop, "HOUSEKEEPING_S", 5.0)  # the worker's answer comes first
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=600)
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=10.0) as busy:
        first = asyncio.create_task(busy.next_token_logprobs([1, 2]))
        await asyncio.sleep(0.1)  # the worker is in its batch of 600 ms
        async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=0.2) as lm:
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout) as caught:
                await lm.next_token_logprobs([3, 4])
            waited = time.monotonic() - t0
        await first
    assert type(caught.value) is RequestTimeout, repr(caught.value)
    assert f"no answer from model {MODEL!r} within 0.2s (" in str(caught.value)
    assert "queue" in str(caught.value)
    assert waited < 3.0, "told when the worker's answer came, not at the next housekeeping"


def test_a_blocking_request_dropped_on_its_own_deadline_is_told_as_a_timeout(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """The blocking path, as above: a ``RequestTimeout`` naming the model, never ``Expired``."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=600)
    busy = asyncio.run(RemoteLM.connect(redis_url, model=MODEL, timeout_s=10.0))
    lm = asyncio.run(RemoteLM.connect(redis_url, model=MODEL, timeout_s=0.2))
    first = threading.Thread(target=busy.next_token_logprobs_sync, args=([1, 2],))
    first.start()
    time.sleep(0.1)  # the worker is in its batch of 600 ms
    with pytest.raises(RequestTimeout) as caught:
        lm.next_token_logprobs_sync([3, 4])
    first.join()
    assert type(caught.value) is RequestTimeout, repr(caught.value)
    assert f"no answer from model {MODEL!r} within 0.2s (" in str(caught.value)
    asyncio.run(lm.close())
    asyncio.run(busy.close())
