"""Smoke check of an engine on the GPU machine, apart from lmpool: imports, device, one request.

    python3 bench/gpu/smoke.py vllm|sglang|lmpool      # run.sh's ``smoke`` step

vllm: imports vLLM and the kernels packages it brought (flashinfer, cutlass, xgrammar), asks its
platform for the device, starts ``LLM`` (in this process, eager, bfloat16, 25% of the GPU) on a
tiny random Llama with a word-level tokenizer (``tests/poolkit.build_model``), and prints the
top-5 next-token log-probs of two prompts beside float32 transformers on the CPU (informational:
bfloat16 differs by up to ~0.1). sglang: imports sglang, its kernels and flashinfer, then runs
SGLang's scheduler through genlm-backend's driver (bfloat16, no CUDA graphs) on a tiny random
Llama with head dim 64 and compares two prompts' rows the same way. lmpool:
torch's view of the GPU only. Exit status 1 when any check fails; every check is attempted.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
IMPORTS = {
    "vllm": ["vllm", "vllm.entrypoints.llm", "flashinfer", "cutlass", "xgrammar", "llguidance"],
    "sglang": [
        "sglang",
        "sgl_kernel",
        "flashinfer",
        "cutlass",
        "xgrammar",
        "sglang.srt.server_args",
    ],
    "lmpool": [],
}
failures: list[str] = []


def check(label: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    try:
        result = fn()
    except BaseException as e:  # a smoke check reports everything, SystemExit of a library too
        failures.append(label)
        print(f"FAIL {label} ({time.perf_counter() - t0:.1f} s): {type(e).__name__}: {e}")
        traceback.print_exc(limit=8, file=sys.stdout)
        return None
    print(f"ok   {label} ({time.perf_counter() - t0:.1f} s){f': {result}' if result else ''}")
    return result


def version_of(module: str) -> str:
    mod = importlib.import_module(module)
    where = getattr(mod, "__file__", None) or "?"
    return f"{getattr(mod, '__version__', '')} from {where}"


def cuda() -> str:
    import torch

    assert torch.cuda.is_available(), "torch sees no CUDA device"
    p = torch.cuda.get_device_properties(0)
    return f"torch {torch.__version__}, {p.name}, sm_{p.major}{p.minor}"


def vllm_requests() -> str:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(REPO / "tests"))
    from poolkit import build_model

    path = build_model(Path(tempfile.mkdtemp(prefix="lmpool-smoke-")))
    llm = LLM(
        model=str(path), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.25,
        max_model_len=256, seed=0,
    )  # fmt: skip
    prompts = [[1, 5, 9, 11], [1, *range(20, 60)]]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    for ids, out in zip(prompts, outputs, strict=True):
        top = out.outputs[0].logprobs[0]  # token id -> Logprob
        with torch.inference_mode():
            want = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1].float(), -1)
        diffs = {t: abs(lp.logprob - float(want[t])) for t, lp in top.items()}
        worst = max(worst, *diffs.values())
        shown = [(t, round(lp.logprob, 3)) for t, lp in top.items()]
        print(f"     prompt of {len(ids)}: top-5 {shown}")
    return f"vLLM served {len(outputs)} prompts; max |vLLM bf16 - transformers fp32| {worst:.3g}"


def sglang_requests() -> str:
    """SGLang's scheduler in this process through genlm-backend's driver (what lmpool's sglang
    backend runs), bfloat16, no CUDA graphs: two prompts' full rows beside fp32 transformers."""
    import torch
    from genlm.backend.llm.sgl import AsyncSGLTransformer
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from poolkit import build_tiny_llama

    path = build_tiny_llama(
        Path(tempfile.mkdtemp(prefix="lmpool-smoke-")),
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    llm = AsyncSGLTransformer.from_name(
        str(path),
        engine_opts={"dtype": "bfloat16", "mem_fraction_static": 0.2, "disable_cuda_graph": True},
    )
    prompts = [[1, 5, 9, 11], [1, *range(20, 60)]]
    rows = llm.batch_next_token_logprobs_sync(prompts).float().cpu()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    for ids, row in zip(prompts, rows, strict=True):
        with torch.inference_mode():
            want = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1].float(), -1)
        worst = max(worst, float((row - want).abs().max()))
        top = torch.topk(row, 5)
        shown = [(int(t), round(float(v), 3)) for v, t in zip(top.values, top.indices, strict=True)]
        print(f"     prompt of {len(ids)}: top-5 {shown}")
    llm._cleanup_engine()
    return f"SGLang served {len(prompts)} prompts; max |SGLang bf16 - fp32 reference| {worst:.3g}"


def main() -> int:
    engine = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    if engine not in IMPORTS:
        raise SystemExit(f"engine: one of {sorted(IMPORTS)}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as lmpool's vllm backend runs
    check("cuda", cuda)
    for module in IMPORTS[engine]:
        check(f"import {module}", functools.partial(version_of, module))
    if engine == "vllm":

        def platform() -> str:
            from vllm.platforms import current_platform

            kind = str(current_platform.device_type)
            assert kind == "cuda", f"vLLM's platform is {kind!r}"
            return kind

        check("vllm platform", platform)
        check("vllm LLM on a tiny model", vllm_requests)
    if engine == "sglang":
        check("sglang scheduler on a tiny model", sglang_requests)
    names = {"vllm": "vllm", "sglang": "sglang", "lmpool": "torch"}
    try:
        print(f"{names[engine]} {md.version(names[engine])}")
    except md.PackageNotFoundError:
        print(f"{names[engine]} not installed")
    print(f"smoke {engine}: {len(failures)} failed{': ' + ', '.join(failures) if failures else ''}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
