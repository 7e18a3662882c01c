"""Loaded by the worker process that ``bench/timeline.py`` starts (this folder is put first on
its ``PYTHONPATH``): marks when each stage of the worker's request path starts and ends."""

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
