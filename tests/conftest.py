"""Settings for the whole suite.

Property tests draw the same examples on every run (``derandomize``): a landing's CI must not
fail on an example no earlier run drew. To search new ground, run with
``HYPOTHESIS_PROFILE=explore`` (random examples, more of them); a failure it finds becomes
a scenario test with the example written out.

One OpenMP thread per process (unless the caller set ``OMP_NUM_THREADS``), for this process
and the ones it starts: the suite's models are tiny, and on a busy 2-core machine torch's
second thread makes each op wait on a descheduled peer (an engine test ran 16 s with two
threads, 0.6 s with one). A job's processes set their own threads whatever this says.

Tests marked ``fused_adam`` (the ZeRO-3 trainer's) need DeepSpeed's FusedAdam op, which a
rank JIT-builds on first use: about 100 s of CPU, paid by every fresh checkout (the build is
keyed by the venv's path). When any is collected, the build starts in the background at the
lowest priority as the session starts, and those tests run last: the suite keeps the two
cores about 1.2 busy on average (it waits on child processes), and the build takes what is
left instead of holding the suite up. A rank that loads the op while the build runs waits for
it (torch locks the build folder).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch reads it when a test first imports it

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


#: What the background build runs: the op as a rank's FusedAdam loads it.
BUILD_FUSED_ADAM = (
    "from pivot.actors.trainer_deepspeed import import_deepspeed\n"
    "import_deepspeed()\n"
    "from deepspeed.ops.op_builder import FusedAdamBuilder\n"
    "FusedAdamBuilder().load(verbose=False)\n"
)


@pytest.hookimpl(trylast=True)  # after pytest groups the items by their fixtures' params
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    last = [item for item in items if item.get_closest_marker("fused_adam")]
    if not last:
        return
    items[:] = [item for item in items if not item.get_closest_marker("fused_adam")] + last
    if config.option.collectonly:
        return
    # never stopped: a build killed midway would leave torch's lock on its folder
    subprocess.Popen(
        [sys.executable, "-c", BUILD_FUSED_ADAM],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(19),  # noqa: PLW1509 - no threads yet at collection
    )
