"""Settings for the whole suite.

Property tests draw the same examples on every run (``derandomize``): a landing's CI must not
fail on an example no earlier run drew. To search new ground, run with
``HYPOTHESIS_PROFILE=explore`` (random examples, more of them); a failure it finds becomes
a scenario test with the example written out.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
