#!/usr/bin/env bash
# The main job: a real supervised training run on CPU with faults injected and recovered.
#   1. install rtrain into .venv (CPU torch, pinned),
#   2. train examples/vision under `rtrain launch` with a crash at step 30 and a GPU-style
#      out-of-memory at batch_size > 16 in the relaunch,
#   3. show the run: `rtrain status` and `rtrain inspect`.
# Usage: scripts/demo.sh [RUN_DIR]   (default runs/demo; removed first)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RUN=${1:-runs/demo}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
RTRAIN=.venv/bin/rtrain
rm -rf "$RUN"

echo "== rtrain launch examples/vision/train.py, faults: crash at step 30, OOM while batch_size > 16"
set +e
RTRAIN_FAULTS="crash@step=30; oom@batch_size>16,attempt=1" \
  "$RTRAIN" launch examples/vision/train.py --config examples/vision/rtrain.toml \
  --run-dir "$RUN" --resume auto --set steps=120
code=$?
set -e
echo "== rtrain exited $code"
echo
echo "== rtrain status $RUN"
"$RTRAIN" status "$RUN"
echo
echo "== rtrain inspect $RUN/checkpoints"
"$RTRAIN" inspect "$RUN/checkpoints"
echo
echo "== what happened, from $RUN/events.jsonl"
.venv/bin/python - "$RUN/events.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    k = e["kind"]
    if k == "launch":
        src = e["resume_from"].rsplit("/", 1)[-1] if e["resume_from"] else "fresh"
        print(f"  attempt {e['attempt']}: launch ({src}) batch_size={e['settings']['batch_size']}"
              f" grad_accum={e['settings']['grad_accum']}")
    elif k == "classification":
        print(f"  attempt {e['attempt']}: {e['failure']}: {e['reason'][:110]}")
    elif k == "degrade":
        print(f"  attempt {e['attempt']}: degrade: {e['change']}")
    elif k in ("finished", "give_up"):
        print(f"  {k}: {e['reason']}")
PY
exit "$code"
