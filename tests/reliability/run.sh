#!/usr/bin/env bash
# The fault and load harness (tests/reliability/README.md).
#   run.sh            the short form (CI, about 15 s): every fault scenario once
#   run.sh --soak S   the soak: S seconds of clients, aborts, weight updates
#                     and injected faults against one server, then its figures
# BUILD (environment) is the build folder (default build).
set -euo pipefail
here=$(dirname "$0")
py=/usr/bin/python3
export BUILD=${BUILD:-build}
[ -x "$BUILD/fp4rollout" ] || { echo "reliability: $BUILD/fp4rollout is missing (run make)" >&2; exit 1; }
if [ "${1:-}" = "--soak" ]; then
  exec timeout $(( ${2:?seconds} + 300 )) $py "$here/soak.py" --seconds "$2" "${@:3}"
fi
exec timeout 300 $py "$here/faults.py" "$@"
