"""A pool on this machine, for the demo, the tests and the benchmarks: a private Redis server
or Redis Cluster (``redis_server``, ``redis_cluster``), a worker as a subprocess (``launch``),
and the demo (``python -m localpool.demo``). Neither side of a deployed pool imports it."""
