"""The engine conformance suite against real SGLang on this machine's first GPU (a step of
``scripts/gpu-check.sh``; needs the ``gpu`` extra). One SGLang engine serves the shipped
tiny policy, its fresh engines made with ``SGLangEngine.fresh()`` (a launch takes a minute);
float32 and SGLang's deterministic kernels, so that a sequence's output is the same batched
or alone, within ``--tolerance``.

    python scripts/gpu_conformance.py [--dtype float32] [--tolerance 1e-3] [--fake]

``--fake``: the same on the test kit's fake SGLang, a dry run of the script on CPU.

Prints one JSON object: launch_s, each check's result ("passed" or its error), passed.
Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pivot.actors.sglang_engine import SGLangEngine  # noqa: E402
from pivot.assets import ASSETS  # noqa: E402
from pivot.engines.conformance import CHECKS, EngineFactory  # noqa: E402
from pivot.engines.loading import read_weights  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument(
        "--fake", action="store_true", help="on the test kit's fake SGLang (a dry run on CPU)"
    )
    args = parser.parse_args(argv)
    api = None
    if args.fake:
        from pivot.actors import fake_sglang

        api = fake_sglang.api(iteration_s=0.001)
    folder = ASSETS / "tiny-policy"
    weights = read_weights(folder)
    began = time.perf_counter()
    first = SGLangEngine.launch(
        str(folder),
        api=api,
        dtype=args.dtype,
        deterministic=True,
        mem_fraction_static=0.3,
        max_running=16,
        wait_s=30.0,  # a step returns as soon as every running sequence has its token
        param_names=weights,
    )
    out: dict[str, object] = {"launch_s": round(time.perf_counter() - began, 2), "checks": {}}
    engines = [first]

    def make() -> SGLangEngine:
        engines.append(engines[-1].fresh())
        return engines[-1]

    factory = EngineFactory(
        name=f"sglang ({args.dtype})",
        make=make,
        weights=lambda: weights,
        logprob_tolerance=args.tolerance,
    )
    passed = True
    for check in CHECKS:
        began = time.perf_counter()
        try:
            check(factory)
            result = "passed"
        except Exception as exc:  # noqa: BLE001 - every check reports, the next one runs
            passed = False
            result = f"{type(exc).__name__}: {exc}"
            if not engines[-1].stats().weights_ready or engines[-1].stats().released:
                engines.append(_serving(engines[-1], weights))
        out["checks"][check.__name__] = {  # type: ignore[index]
            "result": result,
            "s": round(time.perf_counter() - began, 2),
        }
    out["passed"] = passed
    engines[-1].close()
    print(json.dumps(out))
    return 0 if passed else 1


def _serving(engine: SGLangEngine, weights) -> SGLangEngine:  # noqa: ANN001
    """Back to holding everything after a check failed half-way."""
    engine.abort(None)
    engine.resume(["transient", "weights", "stateful"])
    engine.load_weights(weights, engine.stats().weights_version)
    return engine


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
