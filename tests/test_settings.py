"""Settings: read from LMPOOL_* variables in one place, validated at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from poolkit import not_redis

from shared.errors import SettingsError
from shared.settings import DEFAULT_MODEL_NAME, Settings


def test_defaults_and_served_name() -> None:
    s = Settings.from_env({})
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.served_model_name == DEFAULT_MODEL_NAME
    assert Settings.from_env({"LMPOOL_BACKEND": "mock"}).served_model_name == "mock-256"
    assert Settings.from_env({"LMPOOL_MODEL": "/m/x"}).served_model_name == "/m/x"
    assert Settings.from_env({"LMPOOL_MODEL_NAME": "n"}).served_model_name == "n"


def test_values_are_parsed() -> None:
    s = Settings.from_env(
        {
            "LMPOOL_MAX_BATCH": "32",
            "LMPOOL_MAX_WAIT_MS": "0.5",
            "LMPOOL_MAX_QUEUE": "1_000",
            "LMPOOL_LORA": "a=/x, b=/y",
            "LMPOOL_ENGINE_OPTIONS": '{"gpu_memory_utilization": 0.5}',
            "OTHER": "ignored",
        }
    )
    assert (s.max_batch, s.max_wait_ms, s.max_queue) == (32, 0.5, 1000)
    assert s.lora_adapters() == {"a": "/x", "b": "/y"}
    assert s.engine_kwargs() == {"gpu_memory_utilization": 0.5}


def test_misspelled_setting_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(SettingsError, match=r"LMPOOL_MAXBATCH.*LMPOOL_MAX_BATCH"):
        Settings.from_env({"LMPOOL_MAXBATCH": "3"})


@pytest.mark.parametrize(
    ("var", "hint"),
    [
        ("LMPOOL_MAX_BATCH_SIZE", "(did you mean LMPOOL_MAX_BATCH?)"),
        ("LMPOOL_TORCH_THREAD", "(did you mean LMPOOL_TORCH_THREADS?)"),
        ("LMPOOL_REDIS", "(did you mean LMPOOL_REDIS_URL?)"),
        ("LMPOOL_PROMETHEUS", None),
    ],
)
def test_a_misspelled_setting_names_the_closest_ones(var: str, hint: str | None) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({var: "1"})
    message = str(caught.value)
    assert message.startswith(f"unknown setting {var}")
    assert "; known: LMPOOL_" in message
    if hint is None:
        assert "did you mean" not in message
    else:
        assert hint in message


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("LMPOOL_MAX_BATCH", "0"),
        ("LMPOOL_MAX_BATCH", "many"),
        ("LMPOOL_BACKEND", "tgi"),
        ("LMPOOL_DTYPE", "int4"),
        ("LMPOOL_DEVICE", "tpu"),
        ("LMPOOL_DEVICE", "cuda:x"),
        ("LMPOOL_DEVICE", "cuda:-1"),
        ("LMPOOL_DEVICE", "cuda:"),
        ("LMPOOL_REDIS_URL", "http://x"),
        ("LMPOOL_TIMEOUT_S", "-1"),
        ("LMPOOL_LORA", "noequals"),
        ("LMPOOL_ENGINE_OPTIONS", "[1]"),
        ("LMPOOL_ENGINE_OPTIONS", "{bad"),
        ("LMPOOL_KEY_PREFIX", "a:b"),
        ("LMPOOL_QUANTIZATION", "2bit"),
        ("LMPOOL_LOG_LEVEL", "verbose"),
        ("LMPOOL_HEARTBEAT_S", "inf"),
        ("LMPOOL_CLAIM_AFTER_S", "nan"),
    ],
)
def test_bad_values_fail_at_start_up(var: str, value: str) -> None:
    with pytest.raises(SettingsError, match=var.removeprefix("LMPOOL_").split("_")[0]):
        Settings.from_env({var: value})


def test_a_value_of_the_wrong_kind_is_named_in_plain_words() -> None:
    with pytest.raises(SettingsError, match=r"LMPOOL_MAX_BATCH='many' is not an integer$"):
        Settings.from_env({"LMPOOL_MAX_BATCH": "many"})
    with pytest.raises(SettingsError, match=r"LMPOOL_TIMEOUT_S='soon' is not a number$"):
        Settings.from_env({"LMPOOL_TIMEOUT_S": "soon"})


def test_readme_settings_table_is_current() -> None:
    """README lists every setting with its default.

    Regenerate with: python -m shared.settings --update README.md
    """
    from pathlib import Path

    from shared.settings import settings_table

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert settings_table() in readme


def _start_worker(**env: str) -> subprocess.CompletedProcess[str]:
    """``python -m arq worker.WorkerSettings`` with only ``env``'s lmpool settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "arq", "worker.WorkerSettings"],
        env={**clean, **env},
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bad_variable_stops_the_worker_with_one_line() -> None:
    """What an operator sees: the variable and what it must be, exit status 2, no traceback."""
    res = _start_worker(LMPOOL_WIRE_DTYPE="float8")
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "lmpool worker: LMPOOL_WIRE_DTYPE must be one of ('float32', 'float16', 'bfloat16')"
    )
    # a log level logging does not know, an infinite period: tracebacks (exit 1) before
    for var, value in (("LMPOOL_LOG_LEVEL", "verbose"), ("LMPOOL_HEARTBEAT_S", "inf")):
        res = _start_worker(**{var: value})
        assert res.returncode == 2 and res.stderr.startswith(f"lmpool worker: {var} must")
        assert "Traceback" not in res.stderr


def test_the_hf_backend_refuses_an_engines_quantization(tiny_llama: Path) -> None:
    """awq, gptq, fp8 and bitsandbytes are vllm's and sglang's: an hf worker loaded NF4 4-bit
    for each of them, without a word."""
    from worker.backends.hf import HFBackend

    for mode in ("awq", "gptq", "fp8", "bitsandbytes"):
        settings = Settings(model=str(tiny_llama), device="cpu", quantization=mode)
        with pytest.raises(SettingsError, match=f"LMPOOL_QUANTIZATION={mode} is not one"):
            HFBackend(settings)


def test_what_the_machine_lacks_stops_the_worker_naming_the_setting(
    redis_url: str, tiny_llama: Path
) -> None:
    """Found at start-up, after the settings parsed: no CUDA for LMPOOL_DEVICE=cuda, an engine
    not installed, an adapter not there, a metrics port taken or out of range. Each: exit
    status 2, the variable named, no traceback."""
    import importlib.util
    import socket

    import torch

    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    base = {"LMPOOL_REDIS_URL": redis_url}
    mock = {**base, "LMPOOL_BACKEND": "mock"}
    cases = [
        ({**mock, "LMPOOL_METRICS_PORT": "70000"}, "LMPOOL_METRICS_PORT must be a TCP port"),
        ({**mock, "LMPOOL_METRICS_PORT": str(port)}, f"LMPOOL_METRICS_PORT={port}: cannot serve"),
        (
            {**base, "LMPOOL_MODEL": str(tiny_llama), "LMPOOL_LORA": "style=/nonexistent/adapter"},
            "LMPOOL_LORA: adapter 'style' from '/nonexistent/adapter'",
        ),
    ]
    if not torch.cuda.is_available():
        cases.append(({**base, "LMPOOL_DEVICE": "cuda"}, "LMPOOL_DEVICE=cuda, but torch"))
    if importlib.util.find_spec("vllm") is None:
        cases.append(({**base, "LMPOOL_BACKEND": "vllm"}, "LMPOOL_BACKEND=vllm needs vLLM"))
    try:
        for env, says in cases:
            res = _start_worker(**env)
            assert res.returncode == 2, (env, res.stderr[-2000:])
            assert says in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    finally:
        taken.close()


def test_a_missing_model_stops_the_worker_naming_the_setting(redis_url: str) -> None:
    """Found once the worker looks for the model (after arq connected): logged, exit status 2."""
    res = _start_worker(LMPOOL_REDIS_URL=redis_url, LMPOOL_MODEL="/nonexistent/model")
    assert res.returncode == 2
    assert "LMPOOL_MODEL='/nonexistent/model': no such file or directory" in res.stderr
    assert "Traceback" not in res.stderr


def test_an_unreachable_redis_stops_the_worker_with_one_line() -> None:
    """After arq's own retries (a line each), one line naming the URL, password masked; no
    traceback; exit status 1."""
    from localpool.redis_server import free_port

    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    res = _start_worker(LMPOOL_REDIS_URL=url)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"lmpool worker: cannot reach Redis at LMPOOL_REDIS_URL={url.replace('hunter2', '***')}: "
    ), lines[-1]
    assert all("retries remaining" in line for line in lines[:-1]), lines
    assert "hunter2" not in res.stderr and "Traceback" not in res.stderr


def test_an_unreachable_pool_redis_stops_the_worker_naming_it(redis_url: str) -> None:
    """arq's queue answers (LMPOOL_ARQ_REDIS_URL), the pool's Redis does not: found at
    start-up, logged on one line, exit status 1."""
    from localpool.redis_server import free_port

    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    res = _start_worker(LMPOOL_REDIS_URL=url, LMPOOL_ARQ_REDIS_URL=redis_url)
    assert res.returncode == 1, res.stderr
    masked = url.replace("hunter2", "***")
    assert f"cannot reach Redis at LMPOOL_REDIS_URL={masked}: " in res.stderr
    assert "hunter2" not in res.stderr and "Traceback" not in res.stderr


def test_a_redis_url_naming_no_usable_redis_stops_the_worker_with_one_line(
    redis_url: str,
) -> None:
    """LMPOOL_REDIS_URL with a database the server does not have, or the port of something
    that is not Redis (an HTTP server): exit status 2, one line naming the URL, no traceback
    (both were tracebacks through arq and redis-py, exit status 1). The pool's Redis behind a
    good LMPOOL_ARQ_REDIS_URL too."""
    no_db = redis_url.rsplit("/", 1)[0] + "/999"
    with not_redis() as port:
        not_url = f"redis://127.0.0.1:{port}/0"
        cases = [
            (
                {"LMPOOL_REDIS_URL": no_db},
                f"LMPOOL_REDIS_URL={no_db}: ",
                "DB index is out of range",
            ),
            ({"LMPOOL_REDIS_URL": not_url}, f"LMPOOL_REDIS_URL={not_url}: ", "Protocol error"),
            (
                {"LMPOOL_REDIS_URL": no_db, "LMPOOL_ARQ_REDIS_URL": redis_url},
                f"LMPOOL_REDIS_URL={no_db}: ",
                "DB index is out of range",
            ),
            (
                {"LMPOOL_REDIS_URL": redis_url, "LMPOOL_ARQ_REDIS_URL": no_db},
                f"LMPOOL_ARQ_REDIS_URL={no_db}: ",
                "DB index is out of range",
            ),
        ]
        for env, names, says in cases:
            res = _start_worker(LMPOOL_BACKEND="mock", **env)
            assert res.returncode == 2, (env, res.stderr[-3000:])
            assert "Traceback" not in res.stderr, res.stderr[-3000:]
            [line] = [x for x in res.stderr.splitlines() if names in x]
            assert says in line, line
