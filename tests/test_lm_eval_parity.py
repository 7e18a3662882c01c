"""lm-eval's ``lmpool`` model against lm-eval's own ``hf`` model on the same weights, where their
options and tokenizers differ: ``add_bos_token``, a context that starts with BOS, a chat template
that refuses the system role, ``--trust_remote_code``; and the paths that already matched
(truncation, rolling windows, long generations, stop strings, ``max_length``,
``prefix_token_id``), kept so. Log-likelihoods within 1e-4, generations identical.

A private Redis, two hf workers of the tiny Llama of ``poolkit.build_model``:
- ``tiny``: its word-level tokenizer (adds no BOS of its own, as the project's tests use it);
- ``tinybos``: the same weights, the same vocabulary, a tokenizer whose post-processor adds BOS
  (as Llama/Gemma tokenizers do) and a chat template that rejects the system role (as Gemma's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from poolkit import OFFLINE, VOCAB, WorkerProcess, build_model

from localpool.lm_tasks import MC, write_tasks
from localpool.redis_server import RedisServer

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.timeout(600)
TOL = 1e-4
GEMMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
)


def build_bos_model(plain: Path, path: Path) -> Path:
    """``plain``'s weights with a BOS-adding tokenizer and a Gemma-like chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(plain / name, path / name)
    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = GEMMA_LIKE
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, offline_env: None) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm-eval-parity")
    plain = build_model(root / "plain")
    return {"root": root, "tiny": plain, "tinybos": build_bos_model(plain, root / "bos")}


@pytest.fixture(scope="module")
def pool(models: dict[str, Path]) -> Iterator[str]:
    with RedisServer() as server:
        workers = [
            WorkerProcess(
                server.url,
                models["root"] / "logs",
                backend="hf",
                model=models[name],
                model_name=name,
                max_batch=8,
            ).start()
            for name in ("tiny", "tinybos")
        ]
        try:
            for w in workers:
                w.wait_ready()
            yield server.url
        finally:
            for w in workers:
                w.stop()


def ours(pool: str, name: str, **extra: Any) -> Any:
    from lm_eval.api.registry import get_model

    args = ",".join([f"redis_url={pool}", f"model={name}"] + [f"{k}={v}" for k, v in extra.items()])
    return get_model("lmpool").create_from_arg_string(args, {"batch_size": 1, "device": None})


def theirs(path: Path, **extra: Any) -> Any:
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=4, **extra)


def ll_requests(pairs: list[tuple[str, str]]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def gen_requests(items: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance("generate_until", {}, item, i) for i, item in enumerate(items)]


def rolling_requests(texts: list[str]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]


def words(start: int, n: int) -> str:
    return " ".join(f"w{(start + 7 * i) % 900}" for i in range(n))


PAIRS = [(words(1, 8), " " + words(50, 3)), (words(9, 20), " " + words(3, 1))]


# -- add_bos_token=True on a tokenizer that adds no BOS by itself (it did nothing) ----------------
def test_add_bos_token_true_prepends_bos_as_hf_does(pool: str, models: dict[str, Path]) -> None:
    mine = ours(pool, "tiny", add_bos_token=True)
    ref = theirs(models["tiny"], add_bos_token=True)
    got = mine.loglikelihood(ll_requests(PAIRS))
    want = ref.loglikelihood(ll_requests(PAIRS))
    gens = [(words(5, 12), {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False})]
    g_mine, g_ref = mine.generate_until(gen_requests(gens)), ref.generate_until(gen_requests(gens))
    assert mine.tok_encode("w1 w2") == ref.tok_encode("w1 w2")
    for (a, ga), (b, gb) in zip(got, want, strict=True):
        assert abs(a - b) <= TOL and ga == gb
    assert g_mine == g_ref


# -- add_bos_token=True and a context that starts with BOS: one BOS (there were two) -------------
def test_add_bos_token_true_and_a_bos_prefixed_context_give_one_bos(
    pool: str, models: dict[str, Path]
) -> None:
    mine = ours(pool, "tinybos", add_bos_token=True)
    ref = theirs(models["tinybos"], add_bos_token=True)
    text = "<s> w1 w2"
    pairs = [("<s> " + words(1, 8), " " + words(50, 3))]
    got, want = mine.loglikelihood(ll_requests(pairs)), ref.loglikelihood(ll_requests(pairs))
    assert mine.tok_encode(text) == ref.tok_encode(text)
    assert abs(got[0][0] - want[0][0]) <= TOL


# -- a chat template that refuses the system role (it raised) ------------------------------------
def test_chat_template_without_system_role_falls_back_as_hf_does(
    pool: str, models: dict[str, Path]
) -> None:
    mine = ours(pool, "tinybos")
    ref = theirs(models["tinybos"])
    chat = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4"}]
    want = ref.apply_chat_template(chat)
    got = mine.apply_chat_template(chat)
    assert got == want


# -- lm_eval --trust_remote_code, which tasks whose datasets run code need (it was refused) -------
def test_the_trust_remote_code_flag_is_accepted(pool: str, models: dict[str, Path]) -> None:
    docs = [{"question": words(1, 6), "choices": [words(2, 1), words(3, 1)], "answer": 0}]
    tasks = write_tasks(models["root"] / "tasks", mc=docs)
    exe = Path(sys.executable).with_name("lm_eval")
    cmd = [str(exe), "--model", "lmpool", "--model_args", f"redis_url={pool},model=tiny"]
    cmd += ["--tasks", MC, "--include_path", str(tasks), "--trust_remote_code"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")} | OFFLINE
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)
    assert out.returncode == 0


# -- what matched already --------------------------------------------------------------------------
def test_truncation_rolling_generation_and_model_args_as_hf(
    pool: str, models: dict[str, Path]
) -> None:
    mine, ref = ours(pool, "tiny"), theirs(models["tiny"])
    long_ctx = words(2, 400)  # > 256 positions: left truncation
    pairs = [*PAIRS, ("", words(10, 4)), (long_ctx, " " + words(60, 5)), ("", "<s> w1 w2")]
    for (a, ga), (b, gb) in zip(
        mine.loglikelihood(ll_requests(pairs)), ref.loglikelihood(ll_requests(pairs)), strict=True
    ):
        assert abs(a - b) <= TOL and ga == gb, (a, b)
    texts = [words(3, 5), words(4, 600)]
    for a, b in zip(
        mine.loglikelihood_rolling(rolling_requests(texts)),
        ref.loglikelihood_rolling(rolling_requests(texts)),
        strict=True,
    ):
        assert abs(a - b) <= 1e-6 * abs(b) + TOL, (a, b)
    gens = [
        (words(5, 12), {"until": ["\n\n"], "max_gen_toks": 5, "do_sample": False}),
        (words(6, 12), {"until": ["\n\n"], "max_gen_toks": 100, "do_sample": False}),
        (long_ctx, {"until": ["\n\n"], "max_gen_toks": 40, "do_sample": False}),
        (words(7, 12), {"until": ["\n\n"], "max_new_tokens": 3, "temperature": 0.0}),
    ]
    g_mine, g_ref = mine.generate_until(gen_requests(gens)), ref.generate_until(gen_requests(gens))
    assert g_mine == g_ref
    assert [len(g.split()) for g in g_mine][:2] == [5, 100]
    # a stop string inside the greedy generation cuts it there
    stop = g_ref[1].split()[40]
    gens = [(words(6, 12), {"until": [stop], "max_gen_toks": 100, "do_sample": False})]
    g_mine, g_ref = mine.generate_until(gen_requests(gens)), ref.generate_until(gen_requests(gens))
    assert g_mine == g_ref and stop not in g_mine[0]
    # model_args max_length and prefix_token_id as hf's
    mine, ref = (
        ours(pool, "tiny", max_length=64, prefix_token_id=7),
        theirs(models["tiny"], max_length=64, prefix_token_id=7),
    )
    pairs = [("", words(10, 4)), (long_ctx, " " + words(60, 5))]
    for (a, ga), (b, gb) in zip(
        mine.loglikelihood(ll_requests(pairs)), ref.loglikelihood(ll_requests(pairs)), strict=True
    ):
        assert abs(a - b) <= TOL and ga == gb, (a, b)
    for a, b in zip(
        mine.loglikelihood_rolling(rolling_requests(texts)),
        ref.loglikelihood_rolling(rolling_requests(texts)),
        strict=True,
    ):
        assert abs(a - b) <= 1e-6 * abs(b) + TOL, (a, b)
