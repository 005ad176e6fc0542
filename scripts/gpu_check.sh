#!/usr/bin/env bash
# The GPU acceptance run: every GPU-only test (pytest -m gpu) against the real GPU, and a
# summary table of what each check found.
#
#   scripts/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
#
# What it runs (every test marked gpu: tests/test_gpu_real.py): NVML's readings against
# nvidia-smi; a short supervised GPU training with a real CUDA out-of-memory error (allocated
# until CUDA fails) classified oom_gpu and relaunched a rung down; the in-process back-off on a
# real out-of-memory error; a pressure-triggered degrade on GPU memory; async saves (thread
# and fork) of CUDA state restored bitwise; the warm standby handing over to a CUDA attempt;
# a DCP save over NCCL (two GPUs, else skipped with the reason).
#
# It uses the torch that is installed (a CUDA build is the user's to choose: it is never
# installed or replaced here) and says which; it installs rtrain itself (editable), pytest and
# nvidia-ml-py into that environment. PYTHON=... picks the interpreter
# (default: .venv/bin/python if present, else python3). It finishes in under 8 minutes on one
# GPU (the tests are bounded by `timeout`).
#
# GPU_CHECK_DRY_RUN=1 runs it on any machine without installing anything: the tests skip
# where there is no GPU and the table says why (a check of the script itself).
#
# Exit codes: 0 every check passed; 1 a check failed (the table says which); 2 the set-up
# failed (no CUDA torch on a machine with a GPU, the install failed); 77 skipped: no GPU here
# (nothing was run; 77 is the usual "skipped" code of test drivers).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LIMIT_S=${GPU_CHECK_LIMIT_S:-420}   # the tests' share of the 8 minutes
OUT=$(mktemp -d "${TMPDIR:-/tmp}/rtrain-gpu-check-XXXXXX")

gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
           2>/dev/null || true)
fi
cuda=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
DRY=${GPU_CHECK_DRY_RUN:-0}
if [[ "$DRY" != 1 && -z "$gpus" && "$cuda" != 1 ]]; then
    echo "skipped: no GPU (nvidia-smi lists none and torch.cuda.is_available() is False)"
    exit 77
fi
torch_says=$("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' \
             2>/dev/null || echo "none")
if [[ "$DRY" != 1 && "$cuda" != 1 ]]; then
    echo "set-up: nvidia-smi sees a GPU but torch ($torch_says, $PYTHON) cannot use it:" \
         "install a CUDA build of torch into this environment first" >&2
    exit 2
fi
echo "GPU: ${gpus:-unknown (no nvidia-smi)}"
echo "torch: $torch_says (as installed; this script never installs torch)"

# rtrain and what its GPU tests need, not the whole dev extra (Trainer, Lightning: not GPU
# paths, and pinned to versions tested with the CPU torch).
if [[ "$DRY" == 1 ]]; then
    echo "dry run: nothing installed"
elif ! "$PYTHON" -m pip install -q --disable-pip-version-check -e . "pytest>=8" \
        "pytest-timeout==2.4.0" nvidia-ml-py >"$OUT/pip.log" 2>&1; then
    echo "set-up: installing rtrain's test dependencies failed (log: $OUT/pip.log)" >&2
    tail -5 "$OUT/pip.log" >&2
    exit 2
fi
now=$("$PYTHON" -c 'import torch; print(torch.__version__)')
if [[ "$DRY" != 1 && "$torch_says" != "$now "* ]]; then
    echo "set-up: the install replaced torch ($torch_says -> $now): reinstall your CUDA torch" >&2
    exit 2
fi

start=$(date +%s)
timeout "$LIMIT_S" "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests \
    --junitxml="$OUT/junit.xml" -rs >"$OUT/pytest.log" 2>&1
code=$?
took=$(( $(date +%s) - start ))
tail -25 "$OUT/pytest.log"
if [[ $code == 124 ]]; then
    echo "the GPU tests ran past ${LIMIT_S} s: stopped (log: $OUT/pytest.log)"
fi

"$PYTHON" - "$OUT/junit.xml" "$took" "$code" <<'EOF'
import sys
import xml.etree.ElementTree as ET

path, took, code = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = []
try:
    for case in ET.parse(path).iter("testcase"):
        outcome = "PASS"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAIL"
            elif child.tag == "skipped":
                outcome = "SKIP: " + (child.get("message") or "")[:70]
        rows.append((case.get("name", "?"), outcome, float(case.get("time", 0))))
except (OSError, ET.ParseError):
    rows.append(("(no results: pytest did not finish)", "FAIL", 0.0))
width = max(len(n) for n, _, _ in rows)
print(f"\n{'check':<{width}}  {'seconds':>7}  result")
for name, outcome, secs in rows:
    print(f"{name:<{width}}  {secs:7.1f}  {outcome}")
failed = sum(o == "FAIL" for _, o, _ in rows) + (code not in (0, 5) and not rows)
print(f"\n{len(rows)} checks, {sum(o == 'PASS' for _, o, _ in rows)} passed, "
      f"{sum(o == 'FAIL' for _, o, _ in rows)} failed, "
      f"{sum(o.startswith('SKIP') for _, o, _ in rows)} skipped; {took} s")
sys.exit(0 if any(o == "PASS" for _, o, _ in rows) else 3)  # 3: nothing ran on a GPU
EOF
ran=$?
if [[ $code != 0 ]]; then
    echo "FAILED (pytest exit $code; logs in $OUT)"
    exit 1
fi
if [[ $ran != 0 ]]; then
    echo "skipped: no GPU check ran here (every one skipped, the table says why)"
    exit 77
fi
echo "all GPU checks passed"
