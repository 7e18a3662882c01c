"""Calling patterns: event loops and threads as programs and test suites use them.

Successive ``asyncio.run`` calls, an object that outlives the event loops of the tests that use
it (pytest-asyncio's default), a thread running its own loop beside the main thread's, a loop
that ends or is closed with a request still out, sync methods inside a running loop, closing
from another loop or thread, ``async with`` / ``with``. Every request here asks for prompts no
one asked for before, so the pool answers them from a worker (not from a cache).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
from poolkit import redis_connections

from .conftest import TIMEOUT_S, Subjects
from .kit import (
    SUBJECTS,
    assert_row,
    assert_rows,
    fresh_prompts,
    skip_reference,
)

pytestmark = pytest.mark.timeout(30)
PROMPTLY_S = 5.0
"""What "promptly" means here: far below the pool's request timeout (``TIMEOUT_S``)."""
assert PROMPTLY_S < TIMEOUT_S

NOT_THREAD_SAFE = (
    "genlm-backend lacks it: AsyncTransformer's auto-batcher (one query list and one timer for "
    "all callers) is not thread-safe; with two threads' loops the run hangs"
)
LEFT_OUT_QUERY = (
    "genlm-backend lacks it: the query of a request its loop abandoned stays queued, and the next "
    "loop's batch fails on it ({error}) unless reset_async_queries() is called first (the "
    "variant with reset_async_queries() runs for both subjects)"
)
NO_CLOSE = (
    "genlm-backend lacks it: AsyncTransformer has no close() / cleanup() and is no context "
    "manager (AsyncVirtualLM has cleanup(), with and async with, for its engine)"
)


def stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(gone)"


async def check_fresh(lm: Any, model: Any, n: int = 3) -> None:
    prompts = fresh_prompts(n)
    assert_rows(await lm.batch_next_token_logprobs(prompts), prompts, model)
    assert_row(await lm.next_token_logprobs(prompts[0] + [4]), prompts[0] + [4], model)


def test_two_successive_asyncio_runs(lm: Any, hf_model: Any) -> None:
    for _ in range(3):
        started = time.monotonic()
        asyncio.run(check_fresh(lm, hf_model))
        assert time.monotonic() - started < PROMPTLY_S
    prompt = fresh_prompts(1)[0]
    tokens = asyncio.run(lm.sample(prompt, max_tokens=4, eos_token_ids=[], seed=1))
    assert tokens == asyncio.run(lm.sample(prompt, max_tokens=4, eos_token_ids=[], seed=1))


# -- one object, many function-scoped loops ------------------------------------------------------
@pytest.fixture(scope="module", params=SUBJECTS)
def module_lm(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One object per subject for this whole module; each test runs in its own event loop."""
    made = Subjects(request)
    yield made.make(str(request.param))
    made.close()


@pytest.mark.parametrize("round_", range(3))
@pytest.mark.asyncio
async def test_module_scoped_object_in_function_scoped_loops(
    module_lm: Any, hf_model: Any, round_: int
) -> None:
    started = time.monotonic()
    await check_fresh(module_lm, hf_model)
    assert module_lm.next_token_logprobs_sync(fresh_prompts(1)[0]).shape == (1000,)
    assert time.monotonic() - started < PROMPTLY_S


# -- threads -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_thread_with_its_own_loop_beside_the_main_loop(
    lm: Any, subject: str, hf_model: Any
) -> None:
    skip_reference(subject, NOT_THREAD_SAFE)
    rounds = 5
    errors: list[BaseException] = []

    async def run_rounds() -> None:
        for _ in range(rounds):
            await asyncio.wait_for(check_fresh(lm, hf_model), PROMPTLY_S)

    def in_thread() -> None:
        try:
            asyncio.run(run_rounds())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=in_thread)
    thread.start()
    try:
        await run_rounds()
    finally:
        await asyncio.to_thread(thread.join, PROMPTLY_S * rounds)
    assert not thread.is_alive(), f"the thread is stuck:\n{stack_of(thread)}"
    assert not errors, errors


def test_threads_without_loops_use_the_sync_methods(lm: Any, subject: str, hf_model: Any) -> None:
    skip_reference(subject, NOT_THREAD_SAFE)
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            for _ in range(3):
                prompts = fresh_prompts(2)
                assert_rows(lm.batch_next_token_logprobs_sync(prompts), prompts, hf_model)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=in_thread) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROMPTLY_S * 3)
    for t in threads:
        assert not t.is_alive(), f"a thread is stuck:\n{stack_of(t)}"
    assert not errors, errors


# -- a loop that ends with a request out ---------------------------------------------------------
async def leave_a_request_out(lm: Any, prompt: list[int]) -> asyncio.Task[Any]:
    """Start a request, let it be sent, and return without awaiting it."""
    task = asyncio.get_running_loop().create_task(lm.next_token_logprobs(prompt))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done(), "the request should still be out"
    return task


def test_asyncio_run_ends_with_a_request_out(lm: Any, subject: str, hf_model: Any) -> None:
    """``asyncio.run`` cancels the task it leaves; the object goes on in the next loop, for that
    prompt and others."""
    skip_reference(subject, LEFT_OUT_QUERY.format(error="InvalidStateError"))
    prompt = fresh_prompts(1)[0]
    started = time.monotonic()
    task = asyncio.run(leave_a_request_out(lm, prompt))
    assert time.monotonic() - started < PROMPTLY_S, "the request was not cancelled promptly"
    assert task.done()
    started = time.monotonic()
    assert_row(asyncio.run(lm.next_token_logprobs(prompt)), prompt, hf_model)
    asyncio.run(check_fresh(lm, hf_model))
    assert time.monotonic() - started < PROMPTLY_S


def test_loop_closed_with_a_request_out(lm: Any, subject: str, hf_model: Any) -> None:
    """A loop closed outright (no cancellation) while a request is out: the object goes on in a
    new loop, for that prompt and others, without waiting for the dead loop's request."""
    skip_reference(subject, LEFT_OUT_QUERY.format(error="RuntimeError: Event loop is closed"))
    prompt = fresh_prompts(1)[0]
    loop = asyncio.new_event_loop()
    task = loop.run_until_complete(leave_a_request_out(lm, prompt))
    loop.close()
    started = time.monotonic()
    assert_row(asyncio.run(lm.next_token_logprobs(prompt)), prompt, hf_model)
    asyncio.run(check_fresh(lm, hf_model))
    assert_row(lm.next_token_logprobs_sync([*prompt, 5]), [*prompt, 5], hf_model)
    assert time.monotonic() - started < PROMPTLY_S
    # The abandoned coroutine is closed when collected: that must raise nothing either.
    del task
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.parametrize("how", ["asyncio.run", "loop.close"])
def test_reset_async_queries_after_a_loop_ended_with_a_request_out(
    lm: Any, hf_model: Any, how: str
) -> None:
    """genlm-backend's documented recovery: ``reset_async_queries()``, then a new loop."""
    prompt = fresh_prompts(1)[0]
    if how == "asyncio.run":
        asyncio.run(leave_a_request_out(lm, prompt))
    else:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(leave_a_request_out(lm, prompt))
        loop.close()
    lm.reset_async_queries()
    started = time.monotonic()
    assert_row(asyncio.run(lm.next_token_logprobs(prompt)), prompt, hf_model)
    asyncio.run(check_fresh(lm, hf_model))
    assert time.monotonic() - started < PROMPTLY_S


@pytest.mark.asyncio
async def test_wait_for_timeout_cancels_the_request(lm: Any, hf_model: Any) -> None:
    prompt = fresh_prompts(1)[0]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(lm.next_token_logprobs(prompt), 0)
    assert_row(await lm.next_token_logprobs(prompt), prompt, hf_model)


# -- sync methods inside a running loop ---------------------------------------------------------
@pytest.mark.asyncio
async def test_sync_methods_inside_a_running_loop(lm: Any, hf_model: Any) -> None:
    """The blocking forms work where a loop runs (they block it), also while a request of that
    same loop is out."""
    out = fresh_prompts(1)[0]
    pending = asyncio.ensure_future(lm.next_token_logprobs(out))
    await asyncio.sleep(0)
    prompts = fresh_prompts(2)
    assert_row(lm.next_token_logprobs_sync(prompts[0]), prompts[0], hf_model)
    assert_rows(lm.batch_next_token_logprobs_sync(prompts), prompts, hf_model)
    assert_row(await asyncio.wait_for(pending, PROMPTLY_S), out, hf_model)
    await check_fresh(lm, hf_model)


# -- closing -------------------------------------------------------------------------------------
def connections(pool_url: str) -> int:
    return redis_connections(urlparse(pool_url).port or 6379)


def wait_for_connections(pool_url: str, at_most: int) -> int:
    deadline = time.monotonic() + PROMPTLY_S
    while (n := connections(pool_url)) > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


@pytest.mark.parametrize("how", ["close-in-another-loop", "cleanup-in-another-thread"])
@pytest.mark.asyncio
async def test_close_from_another_loop_or_thread_closes_everything(
    subject: str, subjects: Subjects, hf_model: Any, how: str
) -> None:
    """Used from the main loop, a thread's loop and a blocking call; closed elsewhere: every
    connection of the object is closed and every loop's next request fails promptly."""
    skip_reference(subject, NO_CLOSE)
    pool = subjects.request.getfixturevalue("pool")
    before = connections(pool.url)
    lm = subjects.make(subject)
    await check_fresh(lm, hf_model)
    lm.next_token_logprobs_sync(fresh_prompts(1)[0])

    thread_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=thread_loop.run_forever)
    thread.start()
    try:
        in_thread = asyncio.run_coroutine_threadsafe(check_fresh(lm, hf_model), thread_loop)
        await asyncio.wrap_future(in_thread)
        assert connections(pool.url) > before

        if how == "close-in-another-loop":
            await asyncio.to_thread(asyncio.run, lm.close())
        else:
            closer = threading.Thread(target=lm.cleanup)
            closer.start()
            await asyncio.to_thread(closer.join, PROMPTLY_S)
        assert wait_for_connections(pool.url, before) == before, "connections left open"

        started = time.monotonic()
        with pytest.raises(Exception, match="closed"):
            await lm.next_token_logprobs(fresh_prompts(1)[0])
        late = asyncio.run_coroutine_threadsafe(lm.next_token_logprobs([1, 2]), thread_loop)
        with pytest.raises(Exception, match="closed"):
            await asyncio.wrap_future(late)
        with pytest.raises(Exception, match="closed"):
            lm.next_token_logprobs_sync(fresh_prompts(1)[0])
        assert time.monotonic() - started < PROMPTLY_S
    finally:
        thread_loop.call_soon_threadsafe(thread_loop.stop)
        await asyncio.to_thread(thread.join, PROMPTLY_S)
        thread_loop.close()


@pytest.mark.asyncio
async def test_async_with(subject: str, subjects: Subjects, hf_model: Any) -> None:
    skip_reference(subject, NO_CLOSE)
    pool = subjects.request.getfixturevalue("pool")
    before = connections(pool.url)
    async with subjects.make(subject) as lm:
        await check_fresh(lm, hf_model)
    assert wait_for_connections(pool.url, before) == before, "connections left open"
    with pytest.raises(Exception, match="closed"):
        await lm.next_token_logprobs([1, 2])


def test_with(subject: str, subjects: Subjects, hf_model: Any) -> None:
    skip_reference(subject, NO_CLOSE)
    pool = subjects.request.getfixturevalue("pool")
    before = connections(pool.url)
    with subjects.make(subject) as lm:
        prompts = fresh_prompts(2)
        assert_rows(lm.batch_next_token_logprobs_sync(prompts), prompts, hf_model)
        asyncio.run(check_fresh(lm, hf_model))
    assert wait_for_connections(pool.url, before) == before, "connections left open"
    with pytest.raises(Exception, match="closed"):
        lm.next_token_logprobs_sync([1, 2])
