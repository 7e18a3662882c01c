"""The request path inside a worker: read entries, batch them, compute, write the answers.

``reader`` takes entries from the model's streams (leases, priorities, stealing);
``batcher`` decodes, validates, drops expired ones and merges duplicates into jobs;
``compute`` steps the backend over the jobs in one thread; ``writer`` stores results, wakes the
waiting producers and acknowledges; ``reclaim`` takes over the entries of dead consumers;
``consumer`` wires the four together.
"""
