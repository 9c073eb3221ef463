#!/usr/bin/env bash
# comm/ across processes: runs the comm unit test (tests/unit/test_comm.c)
# under mpirun with 2 and 4 ranks, so its collectives sum, gather and
# broadcast real data and the world splits into engines of tp 2. Skipped,
# with a message, when mpirun is absent.
set -euo pipefail
bin=${BUILD:-build}/tests/test_comm
fail() { echo "comm_mpi: $*" >&2; exit 1; }
if ! command -v mpirun >/dev/null 2>&1; then
  echo "comm_mpi: SKIP: mpirun not found (install openmpi-bin: scripts/install-deps.sh)"
  exit 0
fi
[ -x "$bin" ] || fail "$bin is missing (run make)"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# Root needs --allow-run-as-root; --oversubscribe lets 4 ranks share fewer cores.
mpi=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
for np in 2 4; do
  if ! timeout 120 "${mpi[@]}" -np "$np" "$bin" > "$dir/out" 2>&1; then
    tail -40 "$dir/out" >&2
    fail "test_comm failed under mpirun -np $np"
  fi
  grep -q "test_comm: $np rank(s)" "$dir/out" || fail "-np $np did not make a world of $np ranks: $(head -5 "$dir/out")"
  [ "$(grep -c "PASSED" "$dir/out")" -eq "$np" ] || fail "-np $np: not every rank passed"
done
echo "comm_mpi: all checks passed"
