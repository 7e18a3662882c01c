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
