#!/usr/bin/env bash
# Install rtrain with its test dependencies into .venv, lint, and run a tier of the suite.
#
# Usage: scripts/test.sh [--soak] [pytest args...]
#   (default)  every fast test and one end-to-end test of every behaviour (docs/test-coverage.md)
#   --soak     the long matrices and chaos loops (tests marked soak; docs/soak-results.md)
# Tests run in parallel (pytest-xdist): RTRAIN_TEST_WORKERS sets how many. 3 by default: on 2
# cores the default tier took 9:09 with 2 workers, 8:29 with 3, 8:28 with 4 and 8:41 with 6
# (docs/benchmarks.md): the suite is CPU-bound once 3 run, and fewer at once keeps each test
# shorter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tier=()
if [ "${1:-}" = "--soak" ]; then
  tier=(--soak)
  shift
fi
# Debian packages, installed beside pip's work rather than after it: headless Chromium for the
# report test, Slurm and munge for the local cluster of the Slurm tests (scripts/slurm/
# local-cluster.sh would install them on its first start, holding a test worker meanwhile).
# Each test that needs one skips, saying why, where it is missing.
debs=()
[ -x /usr/bin/chromium ] || debs+=(chromium)
command -v slurmctld >/dev/null || debs+=(slurm-wlm munge)
apt_pid=
if [ ${#debs[@]} -gt 0 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${debs[@]}") \
    >/dev/null 2>&1 &
  apt_pid=$!
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The CPU build of torch, pinned: an open range could pull a multi-GB CUDA build. By pip: it
# reads the machine's pip configuration (local wheels, constraints), which uv does not.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
# The rest by uv where it runs (the same versions pip picks, in 5 s rather than 65 s on 2
# cores); by pip otherwise. torch, installed above, satisfies the project's range and stays.
if ! { .venv/bin/python -m pip install -q --disable-pip-version-check uv &&
       .venv/bin/uv pip install -q --python .venv/bin/python -e '.[dev]'; }; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
fi
if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  echo "note: could not install ${debs[*]}; the tests that need them will skip" >&2
fi
.venv/bin/ruff check .
# loadgroup: tests that share one resource of the machine (the local Slurm cluster) carry an
# xdist_group mark and run on one worker, one after the other.
exec .venv/bin/python -m pytest -q -n "${RTRAIN_TEST_WORKERS:-3}" --dist loadgroup "${tier[@]}" "$@"
