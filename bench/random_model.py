"""Write a random-weight Llama of a named shape with a real tokenizer, for benchmarks anywhere.

A machine that cannot reach a model hub (or carry a checkpoint) still measures throughput at a
real model's shape: the weights are random, the shapes, vocabulary and tokenizer are real. The
shapes are SmolLM2's (https://huggingface.co/HuggingFaceTB): ``135m`` the bundled default,
``1.7b`` its largest sibling.

    python bench/random_model.py /tmp/smollm2-1.7b --shape 1.7b --tokenizer DIR
    LMPOOL_MODEL=/tmp/smollm2-1.7b python bench/throughput.py --device cuda --dtype bfloat16

``--tokenizer`` is an HF directory holding tokenizer.json (default: the converted default
model's, which needs the bundled GGUF).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

SMOLLM2: dict[str, Any] = {
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}
SHAPES: dict[str, dict[str, Any]] = {
    # a forward pass as cheap next to the LM head and the rows as a GPU's: what the pool adds
    # around the model shows (bench/efficiency.py)
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 100000.0,
    },
    # the same with a head size vLLM's CPU attention takes (32; "tiny"'s 16 it refuses)
    "tiny-hd32": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 100000.0,
    },
    "135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000.0,
    },
    "1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rope_theta": 130000.0,
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def default_tokenizer_dir() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchkit import model_dir

    return model_dir()


def build(out: Path, shape: str, tokenizer: Path, dtype: torch.dtype, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2, **SHAPES[shape])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 1.7B on 2 cores is slow
    with torch.device(device):
        # Any: mypy reads PreTrainedModel.to (a functools.wraps wrapper) as an unbound function
        model: Any = LlamaForCausalLM(config)
        model = model.to(dtype)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    if not (out / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in {tokenizer}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    parser.add_argument("--tokenizer", type=Path, help="HF directory with tokenizer.json")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tokenizer = args.tokenizer or default_tokenizer_dir()
    build(args.out, args.shape, tokenizer, getattr(torch, args.dtype), args.seed)
    print(f"{args.out}: SmolLM2-{args.shape} shape, random {args.dtype} weights, "
          f"tokenizer from {tokenizer} ({time.perf_counter() - started:.1f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
