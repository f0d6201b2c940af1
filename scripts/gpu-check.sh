#!/usr/bin/env bash
# The prepared GPU check (issue 15, part 4), run by hand on a fresh machine with one GPU and
# the package registries, from the repository root:  bash scripts/gpu-check.sh
#
#   1. builds the gpu venv (.venv-gpu: pivot with the 'gpu' and 'dev' extras; SGLang pins its
#      own CUDA torch) and times it;
#   2. checks pivot/actors/sglang_surface.py against the installed SGLang's source;
#   3. runs the engine conformance suite against real SGLang on the GPU
#      (scripts/gpu_conformance.py);
#   4. runs `pivot bench shift` on the tiny job on CUDA (cluster.accelerator = "cuda",
#      model.engine = "sglang", model.dtype = "bfloat16", trainer_devices = 1) under pivot
#      and one baseline (disaggregated), a few steps each: shift phases (release, GPS read,
#      register), migration abort / dispatch / re-prefill medians, samples/s per deployment;
# then prints one JSON object with all of it. Each step's first line says which step it is.
#
# Step 4's job has max(3, G) job devices on the G visible GPUs (disaggregated with a GenRM
# needs 3: rollout, GenRM, trainer), job device N on GPU N mod G (cluster.gpus): on one GPU
# all three share GPU 0, each SGLang engine taking its share of model.mem_fraction_static
# after the trainer rank's cluster.trainer_gpu_fraction (pivot/accelerator.py); on 3 or more
# GPUs each job device has a GPU of its own.
#
# Status: written before any GPU was available; not run yet.
set -uo pipefail

STEPS=${PIVOT_GPU_CHECK_STEPS:-3}
VENV=${PIVOT_GPU_VENV:-.venv-gpu}
OUT=$(mktemp -d -t pivot-gpu-check.XXXXXX)
PY="$VENV/bin/python"

echo "[1/4] building $VENV (pip install -e '.[gpu,dev]') ..."
t0=$(date +%s)
if [ ! -x "$PY" ]; then python3 -m venv "$VENV" || exit 1; fi
"$PY" -m pip install -q --upgrade pip >"$OUT/install.log" 2>&1
if ! "$PY" -m pip install -q -e '.[gpu,dev]' >>"$OUT/install.log" 2>&1; then
    echo "install failed; see $OUT/install.log" >&2
    tail -20 "$OUT/install.log" >&2
    exit 1
fi
install_s=$(( $(date +%s) - t0 ))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$OUT/gpu.txt" 2>&1 || true

echo "[2/4] SGLang source check (scripts/check_sglang_api.py against the installed sglang) ..."
site=$("$PY" -c 'import sglang, pathlib; print(pathlib.Path(sglang.__file__).parents[1])')
"$PY" scripts/check_sglang_api.py "$site" >"$OUT/source.txt" 2>&1
source_rc=$?

echo "[3/4] engine conformance suite against SGLang on the GPU (scripts/gpu_conformance.py) ..."
"$PY" scripts/gpu_conformance.py >"$OUT/conformance.json" 2>"$OUT/conformance.log"
conformance_rc=$?

GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
DEVICES=$(( GPUS > 3 ? GPUS : 3 ))
# job device N on GPU N mod GPUS (no GPU seen: all on GPU 0, and pivot says what is missing)
MAP=$(sep=""; for ((d = 0; d < DEVICES; d++)); do
    printf '%s%d' "$sep" $(( d % (GPUS > 0 ? GPUS : 1) )); sep=", "; done)
MAP="[$MAP]"
echo "[4/4] pivot bench shift on $GPUS GPUs (cluster.gpus = $MAP), model.engine = sglang," \
    "pivot and disaggregated, $STEPS steps ..."
sed -e 's/^max_running = 32$/max_running = 32\nengine = "sglang"\ndtype = "bfloat16"/' \
    -e "s/^devices = 4 .*/devices = $DEVICES\naccelerator = \"cuda\"\ngpus = $MAP/" \
    -e 's/^trainer_devices = 2 .*/trainer_devices = 1/' configs/tiny.toml >"$OUT/gpu-tiny.toml"
"$VENV/bin/pivot" bench shift "$OUT/gpu-tiny.toml" --steps "$STEPS" \
    --deployments pivot disaggregated --run-dir "$OUT/runs" --json \
    >"$OUT/bench.json" 2>"$OUT/bench.log"
bench_rc=$?

"$PY" - "$OUT" "$install_s" "$source_rc" "$conformance_rc" "$bench_rc" <<'EOF'
import json, sys
from pathlib import Path

out, install_s, source_rc, conformance_rc, bench_rc = sys.argv[1:]
out = Path(out)


def parsed(name, rc, log):
    text = (out / name).read_text().strip()
    try:
        return json.loads(text.splitlines()[-1])
    except (IndexError, ValueError):
        tail = (out / log).read_text().strip().splitlines()[-5:]
        return {"error": f"exit {rc}", "tail": tail}


result = {
    "gpu": (out / "gpu.txt").read_text().strip(),
    "install_s": round(float(install_s), 1),
    "source_check": "passed" if source_rc == "0" else (out / "source.txt").read_text().strip(),
    "conformance": parsed("conformance.json", conformance_rc, "conformance.log"),
    "bench": parsed("bench.json", bench_rc, "bench.log"),
    "logs": str(out),
}
print(json.dumps(result))
EOF
