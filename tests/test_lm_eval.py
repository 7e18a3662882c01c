"""lm-evaluation-harness on the pool (``producer/harness.py``) against lm-eval's own ``hf`` model.

A tiny random Llama with a word-level tokenizer (``poolkit.build_model``: 256 positions, so the
perplexity task's long documents take several windows) serves from one hf worker; lm-eval's
``HFLM`` loads the same directory in this process. Three local tasks (``localpool.lm_tasks``):
multiple choice (some choices are the model's greedy continuation, so ``is_greedy`` is true
there), perplexity, and greedy generation with a stop string. Every loglikelihood request
within 1e-4 of ``hf``'s, the same ``is_greedy``, the same generations and task metrics. A
document's rolling log-likelihood (a sum over hundreds of tokens, about -1000 for the longest,
which float32 resolves to 6e-5) is compared at 1e-6 relative.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from poolkit import OFFLINE, VOCAB, WorkerProcess, build_model

from localpool.lm_tasks import GEN, MC, PPL, write_tasks
from localpool.redis_server import RedisServer, free_port
from shared.errors import SettingsError

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.timeout(300)
TOL = 1e-4
WORDS = range(3, VOCAB)
"""Token ids of plain words (w0... are ids 3...): no special tokens in the data."""


def text(ids: list[int]) -> str:
    return " ".join(f"w{i - 3}" for i in ids)


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def make_docs(model_dir: Path, seed: int = 0) -> dict[str, Any]:
    """Docs of the three tasks; greedy choices and the generation's stop word come from the
    model itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    mc: list[dict[str, Any]] = []
    while len(mc) < 12:
        context = [rng.choice(WORDS) for _ in range(rng.randrange(6, 40))]
        best = greedy(model, context, rng.randrange(1, 4))
        if any(t not in WORDS for t in best):
            continue
        choices = [text([rng.choice(WORDS) for _ in range(rng.randrange(1, 5))]) for _ in range(3)]
        at = rng.randrange(4)
        choices.insert(at, text(best))
        mc.append({"question": text(context), "choices": choices, "answer": at})
    ppl = [{"text": text([rng.choice(WORDS) for _ in range(n)])} for n in (20, 300, 90)]
    gen: list[dict[str, Any]] = [
        {"question": text([rng.choice(WORDS) for _ in range(12)]), "answer": "w1"}
    ]
    gen += [{"question": d["question"], "answer": d["choices"][d["answer"]]} for d in mc[:5]]
    # the stop string: the third word of the first question's greedy generation
    first = [int(word[1:]) + 3 for word in gen[0]["question"].split()]
    stop = text(greedy(model, first, 3)[2:])
    return {"mc": mc, "ppl": ppl, "gen": gen, "until": [stop]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, offline_env: None) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lm-eval")
    model_dir = build_model(root / "model")
    docs = make_docs(model_dir)
    tasks = write_tasks(
        root / "tasks", docs["mc"], docs["ppl"], docs["gen"], docs["until"], max_gen_toks=40
    )
    return {"root": root, "model": model_dir, "tasks": tasks}


@pytest.fixture(scope="module")
def hf_worker(setup: dict[str, Any]) -> Iterator[WorkerProcess]:
    """A private Redis and one hf worker of the tiny model (named ``tiny``), starting."""
    with RedisServer() as server:
        worker = WorkerProcess(
            server.url,
            setup["root"] / "logs",
            backend="hf",
            model=setup["model"],
            model_name="tiny",
            max_batch=8,
        ).start()
        try:
            yield worker
        finally:
            worker.stop()


@pytest.fixture(scope="module")
def pool(hf_worker: WorkerProcess, hf_results: dict[str, Any]) -> str:
    """The URL of that pool, once it serves (it loaded while ``hf`` evaluated)."""
    return hf_worker.wait_ready().redis_url


def evaluate(model: Any, tasks: Path, names: list[str], **kwargs: Any) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        tasks=names,
        # lm-eval's thousands of built-in tasks take seconds to index: ours only
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        **kwargs,
    )
    assert out is not None
    return out


def responses(out: dict[str, Any], task: str) -> list[Any]:
    """Each sample's raw responses, in doc order."""
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"] for s in samples]


@pytest.fixture(scope="module")
def hf_results(setup: dict[str, Any], hf_worker: WorkerProcess) -> dict[str, Any]:
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(setup["model"]), device="cpu", dtype="float32", batch_size=4)
    return evaluate(hf, setup["tasks"], [MC, PPL, GEN])


def test_same_loglikelihoods_greedy_flags_generations_and_metrics(
    setup: dict[str, Any], pool: str, hf_results: dict[str, Any]
) -> None:
    out = evaluate(
        "lmpool", setup["tasks"], [MC, PPL, GEN], model_args=f"redis_url={pool},model=tiny"
    )
    greedy_seen = 0
    for ours, theirs in zip(responses(out, MC), responses(hf_results, MC), strict=True):
        for (ll, is_greedy), (ref_ll, ref_greedy) in zip(
            [r[0] for r in ours], [r[0] for r in theirs], strict=True
        ):
            assert abs(ll - ref_ll) <= TOL and is_greedy == ref_greedy
            greedy_seen += is_greedy
    assert greedy_seen >= 8  # the greedy choices (a few random ones may be greedy too)
    for ours, theirs in zip(responses(out, PPL), responses(hf_results, PPL), strict=True):
        assert math.isclose(ours[0][0], theirs[0][0], rel_tol=1e-6, abs_tol=TOL)
    assert responses(out, GEN) == responses(hf_results, GEN)
    gens = [r[0][0] for r in responses(out, GEN)]
    assert len(gens[0].split()) <= 2 < max(len(g.split()) for g in gens), gens  # cut at the stop
    for task, result in hf_results["results"].items():
        for metric, value in result.items():
            if isinstance(value, float) and "stderr" not in metric:
                got = out["results"][task][metric]
                assert math.isclose(got, value, rel_tol=1e-6, abs_tol=1e-9), (task, metric)
    assert out["config"]["model_fingerprint"]


def run_cli(setup: dict[str, Any], pool: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """The ``lm_eval`` command of this venv, as a user runs it: nothing imported first."""
    exe = Path(sys.executable).with_name("lm_eval")
    cmd = [str(exe), "--model", "lmpool", "--model_args", f"redis_url={pool},model=tiny"]
    cmd += ["--tasks", MC, "--include_path", str(setup["tasks"]), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")} | OFFLINE
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)


def test_the_lm_eval_command_finds_lmpool_and_caches_its_answers(
    setup: dict[str, Any], pool: str, hf_results: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``lm_eval --model lmpool`` in a new process (the package registered the model), with
    lm-eval's response cache (``--use_cache``): a second run, here in-process, answers every
    request from that cache."""
    cache = setup["root"] / "cache" / "lmpool"
    first = run_cli(setup, pool, "--use_cache", str(cache), "--output_path", str(setup["root"]))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Running loglikelihood requests" in first.stderr  # lm-eval's progress bar
    (found,) = list(setup["root"].rglob("results_*.json"))
    results = json.loads(found.read_text())["results"][MC]
    assert results["acc,none"] == hf_results["results"][MC]["acc,none"]
    with caplog.at_level(logging.INFO, logger="lm_eval"):
        again = evaluate(
            "lmpool",
            setup["tasks"],
            [MC],
            model_args=f"redis_url={pool},model=tiny",
            use_cache=str(cache),
        )
    assert "Cached requests: 48, Requests remaining: 0" in caplog.text
    assert again["results"][MC]["acc,none"] == results["acc,none"]


@pytest.mark.parametrize(
    ("model_args", "names"),
    [
        ("model=tiny,batch_sz=3", "batch_sz"),
        ("model=tiny,concurrency=many", "concurrency='many'"),
        ("model=tiny,priority=urgent", "priority='urgent'"),
        ("model=no-such-model", "model='no-such-model'"),
        (
            "model=tiny,redis_url=redis://127.0.0.1:{port}/0",
            "redis_url='redis://127.0.0.1:{port}/0'",
        ),
    ],
)
def test_a_wrong_model_arg_or_an_unreachable_redis_fails_at_once_naming_it(
    pool: str, model_args: str, names: str
) -> None:
    from lm_eval.api.registry import get_model

    port = free_port()
    args = model_args.format(port=port)
    if "redis_url" not in args:
        args += f",redis_url={pool}"
    t0 = time.monotonic()
    with pytest.raises((SettingsError, ConnectionError)) as caught:
        get_model("lmpool").create_from_arg_string(args, {"batch_size": 1, "device": None})
    assert time.monotonic() - t0 < 2.0
    assert names.format(port=port) in str(caught.value)


def test_a_killed_worker_mid_evaluation_changes_nothing(
    setup: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """Two mock workers, slowed down; once one has answered a batch it is SIGKILLed with more
    in hand. The evaluation completes, equal to a run on the same pool before the kill."""
    import redis

    slow = {
        "backend": "mock",
        "mock_vocab_size": 300,
        "mock_delay_ms": 150,
        "claim_after_s": 1,
        "max_batch": 4,
    }
    args = f"redis_url={redis_url},model=mock-300"
    tasks = setup["tasks"]
    victim = WorkerProcess(redis_url, tmp_path, **slow).start()
    survivor = WorkerProcess(redis_url, tmp_path, **slow).start()
    try:
        victim.wait_ready()
        survivor.wait_ready()
        clean = evaluate("lmpool", tasks, [MC], model_args=args)
        redis.Redis.from_url(redis_url).delete(*cached_results(redis_url))  # all computed again
        box: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: box.update(out=evaluate("lmpool", tasks, [MC], model_args=args))
        )
        thread.start()
        deadline = time.monotonic() + 60
        while int(victim.info().get("requests", 0)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive(), "the evaluation ended before the kill"
        victim.kill()
        thread.join(120)
        assert not thread.is_alive()
    finally:
        victim.stop()
        survivor.stop()
    assert responses(box["out"], MC) == responses(clean, MC)
    assert box["out"]["results"][MC] == clean["results"][MC]


def cached_results(url: str) -> list[bytes]:
    import redis

    from shared.keys import Keys

    r = redis.Redis.from_url(url)
    try:
        return list(r.scan_iter(Keys().results("mock-300"), count=1000))
    finally:
        r.close()


@pytest.mark.asyncio
async def test_greedy_scores_and_greedy_samples_through_the_pool(
    redis_url: str, workers: Any
) -> None:
    """The pool's side of the adapter: ``score(..., greedy=True)`` (a request of its own, the
    plain form unchanged) and ``sample(..., temperature=0)`` (greedy decoding)."""
    from producer import RemoteLM
    from worker.backends.mock import MockBackend

    workers(redis_url, backend="mock", mock_vocab_size=300)
    ref = MockBackend(300)
    async with await RemoteLM.connect(redis_url, model="mock-300") as lm:
        best = int(ref.logprobs([[1, 2]], None)[0].argmax())
        plain = await lm.score([1, 2], [best, 4])
        flagged = await lm.score([1, 2], [best, 4], greedy=True)
        assert plain.shape == (2,) and flagged.shape == (2, 2)
        assert torch.equal(flagged[:, 0], plain)
        assert torch.equal(flagged, ref.score([1, 2], [best, 4], None, greedy=True))
        assert flagged[0, 1] == 1.0
        tokens = await lm.sample([1, 2], 6, [299], temperature=0.0)
        assert tokens == ref.sample([1, 2], 6, [299], 0.0, None, None)
        assert tokens[0] == best
