"""Loaded by the worker process that ``bench/timeline.py`` starts (this folder is put first on
its ``PYTHONPATH``): marks when each stage of the worker's request path starts and ends.
``bench/smc_timeline.py`` and ``bench/gc_pauses.py`` put it first for every process they start
(see below)."""

import os

if os.environ.get("BENCH_TIMELINE_OUT"):
    import timeline_marks

    from worker.backends import mock
    from worker.stream import compute, consumer, reader, writer

    timeline_marks.to_file(os.environ["BENCH_TIMELINE_OUT"])
    timeline_marks.wrap(reader.Reader, "_xreadgroup", "worker XREADGROUP")
    timeline_marks.wrap(consumer.Consumer, "_take", "worker decode + validate")
    timeline_marks.wrap(compute.Compute, "step", "worker step")
    timeline_marks.wrap(mock.MockBackend, "logprobs", "worker mock rows")
    timeline_marks.wrap(compute, "encode_result", "worker encode")
    timeline_marks.wrap(writer.Writer, "write", "worker write pipeline")

if os.environ.get("BENCH_SMC_TIMELINE"):
    # bench/smc_timeline.py: every process of bench/efficiency.py's pool (the producer in the
    # bench's own process, the hf worker) marks its stages of an SMC step, each to a file of
    # its own; stages that an older checkout lacks are left out.
    import timeline_marks

    timeline_marks.to_file(f"{os.environ['BENCH_SMC_TIMELINE']}.{os.getpid()}")

    def _wrap(owner: object, attr: str, name: str) -> None:
        if hasattr(owner, attr):
            timeline_marks.wrap(owner, attr, name)

    from producer import loop as _loop

    _wrap(_loop.LoopState, "_flush", "P submit")
    _wrap(_loop.LoopState, "_deliver", "P deliver")
    _wrap(_loop.LoopState, "_fetch", "P fetch")
    _wrap(_loop.LoopState, "request", "P request")
    from worker.backends.hf import backend as _backend
    from worker.backends.hf import kv_cache as _kv_cache
    from worker.stream import compute as _compute
    from worker.stream import consumer as _consumer
    from worker.stream import reader as _reader
    from worker.stream import writer as _writer

    _wrap(_reader.Reader, "_xreadgroup", "W read")
    _wrap(_consumer.Consumer, "_take", "W decode")
    _wrap(_compute.Compute, "step", "W step")
    _wrap(_backend.HFBackend, "logprobs", "W logprobs")
    _wrap(_kv_cache.KVCache, "_forward", "W forward")
    _wrap(_kv_cache.KVCache, "_store", "W KV store")
    _wrap(_compute, "encode_results", "W encode")
    _wrap(_writer.Writer, "write", "W write")

if os.environ.get("BENCH_GC_OUT"):
    # bench/gc_pauses.py: each full collection of 1 ms or more, one line each to
    # $BENCH_GC_OUT.<pid> (the time, the pause in ms, 1 once gc.freeze ran), after a first
    # line with the process' start and command
    import gc
    import sys
    import time

    _out = open(f"{os.environ['BENCH_GC_OUT']}.{os.getpid()}", "w", buffering=1)  # noqa: SIM115
    _out.write(f"{time.time():.3f} " + " ".join(sys.argv)[:200] + "\n")
    _began = [0.0]
    _frozen = [0]
    _freeze = gc.freeze

    def _noted_freeze() -> None:  # gc.get_freeze_count() walks every frozen object: not here
        _freeze()
        _frozen[0] = 1

    gc.freeze = _noted_freeze

    def _timed(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            _began[0] = time.perf_counter()
            return
        took = time.perf_counter() - _began[0]
        if took >= 0.001:
            _out.write(f"{time.time():.3f} {took * 1000:.1f} {_frozen[0]}\n")

    gc.callbacks.append(_timed)
