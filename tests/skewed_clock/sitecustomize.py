"""Put first on a process' ``PYTHONPATH`` (``tests/test_clock_skew.py``): its wall clock
(``time.time``) runs ``TEST_CLOCK_SHIFT_S`` seconds off, as on a host whose clock is not the
Redis server's."""

import os
import time

_shift = float(os.environ.get("TEST_CLOCK_SHIFT_S", "0"))
_real = time.time
time.time = lambda: _real() + _shift
