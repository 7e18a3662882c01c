"""Small lm-evaluation-harness tasks over local JSONL files (tests and ``bench/lm_eval.py``).

No hub data set is fetched: each task is a YAML file whose ``dataset_path: json`` reads a JSONL
file written beside it. Give the folder to lm-eval as ``--include_path`` (or
``TaskManager(include_path=...)``).

- ``lmpool_mc`` (multiple choice): docs ``{"question", "choices", "answer"}``; acc, acc_norm.
- ``lmpool_ppl`` (``loglikelihood_rolling``): docs ``{"text"}``; word and byte perplexity,
  bits per byte.
- ``lmpool_gen`` (``generate_until``, greedy): docs ``{"question", "answer"}``; exact match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MC, PPL, GEN = "lmpool_mc", "lmpool_ppl", "lmpool_gen"

_HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
_MC = """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
_PPL = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
_GEN = """output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, name: str, docs: list[dict[str, Any]], body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    head = _HEAD.format(name=name, data=json.dumps(str(data.resolve())))
    (folder / f"{name}.yaml").write_text(head + body)


def write_tasks(
    folder: Path,
    mc: list[dict[str, Any]] | None = None,
    ppl: list[dict[str, Any]] | None = None,
    gen: list[dict[str, Any]] | None = None,
    until: list[str] | None = None,
    max_gen_toks: int = 32,
) -> Path:
    """Write the tasks whose docs are given into ``folder`` (their ``include_path``)."""
    if mc is not None:
        write_task(folder, MC, mc, _MC.format())
    if ppl is not None:
        write_task(folder, PPL, ppl, _PPL.format())
    if gen is not None:
        body = _GEN.format(until=json.dumps(until or ["\n\n"]), max_gen_toks=max_gen_toks)
        write_task(folder, GEN, gen, body)
    return folder
