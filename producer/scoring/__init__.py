"""The offline scorer (``lmpool-score``), one module a step; :mod:`producer.score` is its face.

``options``  what to compute for every line (``ScoreOptions``)
``inputs``   reading JSONL input lines into requests or line errors
``files``    where an output's files are; reading an append-only JSONL file back
``shards``   full distributions in ``.npy`` shards; ``load_logprobs``
``outputs``  writing the output and resuming it (lock, repair, the ids already done)
``run``      the run loop over a ``RemoteLM`` (``score_jsonl``, ``ScoreStats``)
``job``      the arq job ``score_file``: arguments defined once, body, enqueueing, progress
``cli``      argument parsing and ``main``
"""
