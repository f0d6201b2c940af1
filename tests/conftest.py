"""Settings for the whole suite.

Property tests draw the same examples on every run (``derandomize``): a landing's CI must not
fail on an example no earlier run drew. To search new ground, run with
``HYPOTHESIS_PROFILE=explore`` (random examples, more of them); a failure it finds becomes
a scenario test with the example written out.

One OpenMP thread per process (unless the caller set ``OMP_NUM_THREADS``), for this process
and the ones it starts: the suite's models are tiny, and on a busy 2-core machine torch's
second thread makes each op wait on a descheduled peer (an engine test ran 16 s with two
threads, 0.6 s with one). A job's processes set their own threads whatever this says.
"""

from __future__ import annotations

import os

from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch reads it when a test first imports it

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
