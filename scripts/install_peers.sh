#!/usr/bin/env bash
# Build the venv of the peer tools that scripts/bench_goodput.py compares rtrain with:
# NVIDIA's ft_launcher (nvidia-resiliency-ext) and DLRover's Flash Checkpoint. They live in their
# own venv, never in .venv: the suite and CI do not need them, and their pins would move
# rtrain's. Each installs or not on its own; the benchmark prints a missing one as "not installed".
#
# Usage: scripts/install_peers.sh [DIR]      (default bench-out/peers-venv)
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-bench-out/peers-venv}
PY=${PYTHON:-python3}
[ -x "$DIR/bin/python" ] || "$PY" -m venv "$DIR" || exit 1
pip=("$DIR/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU build of torch, the version the project pins: the same kernels, so a peer's final
# state can be compared bit for bit with the uninterrupted run's.
"${pip[@]}" torch==2.13.0 || exit 1

# nvidia-resiliency-ext 0.7.0 ships wheels for CPython 3.12 and 3.14 only; apart from one CUPTI
# module it is pure Python, so the 3.12 wheel unpacked into a directory of its own runs on other
# versions. Its dependencies install normally.
nvrx="$DIR/nvrx"
if "${pip[@]}" --no-deps --target "$nvrx" --python-version 3.12 \
    --platform manylinux_2_39_x86_64 --only-binary=:all: nvidia-resiliency-ext==0.7.0; then
  site=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  realpath "$nvrx" > "$site/nvrx.pth"
  # its dependencies, as its metadata lists them (less the optional extras)
  mapfile -t deps < <("$DIR/bin/python" - "$nvrx" <<'PYEOF'
import sys
from importlib.metadata import distributions
for dist in distributions(path=[sys.argv[1]]):
    for req in dist.requires or []:
        if "extra ==" not in req:
            print(req.split(";")[0].replace(" ", "").replace("(", "").replace(")", ""))
PYEOF
  )
  "${pip[@]}" "${deps[@]}" || echo "note: ft_launcher's dependencies did not install" >&2
  # its console script is not installed by --target: a small one that runs its entry point
  cat > "$DIR/bin/ft_launcher" <<PYEOF
#!$(realpath "$DIR")/bin/python
import sys
from nvidia_resiliency_ext.fault_tolerance.launcher import main
sys.exit(main())
PYEOF
  chmod +x "$DIR/bin/ft_launcher"
else
  echo "note: nvidia-resiliency-ext did not install; the benchmark skips ft_launcher" >&2
fi

"${pip[@]}" 'dlrover[k8s,torch]==0.6.1' \
  || echo "note: dlrover did not install; the benchmark skips it" >&2
echo "peers venv: $DIR"
