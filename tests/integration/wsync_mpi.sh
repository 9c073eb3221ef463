#!/usr/bin/env bash
# Weight sync broadcast whole to every rank, across processes: runs
# tests/unit/test_wsync_rank.c under mpirun with 3 and 5 ranks. World rank 0
# plays the trainer and broadcasts each bucket over MPI (standing in for the
# NCCL broadcast of docs/protocol.md, "Weights over NCCL"); the other ranks
# are one or two engines of tp 2, each keeping its shard; every rank's vote
# decides the commit: all switch, or (a wrong checksum on one rank, the
# trainer gone mid-update) none does. Skipped, with a message, when mpirun
# is absent.
set -euo pipefail
bin=${BUILD:-build}/tests/test_wsync_rank
fail() { echo "wsync_mpi: $*" >&2; exit 1; }
if ! command -v mpirun >/dev/null 2>&1; then
  echo "wsync_mpi: SKIP: mpirun not found (install openmpi-bin: scripts/install-deps.sh)"
  exit 0
fi
[ -x "$bin" ] || fail "$bin is missing (run make)"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# Root needs --allow-run-as-root; --oversubscribe lets 5 ranks share fewer cores.
mpi=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
for np in 3 5; do
  if ! timeout 300 "${mpi[@]}" -np "$np" "$bin" > "$dir/out" 2>&1; then
    tail -40 "$dir/out" >&2
    fail "test_wsync_rank failed under mpirun -np $np"
  fi
  grep -q "test_wsync_rank: $((np - 1)) server ranks, all-or-nothing checked" "$dir/out" ||
    fail "-np $np did not run the all-or-nothing case: $(head -5 "$dir/out")"
  [ "$(grep -c "PASSED" "$dir/out")" -eq "$np" ] || fail "-np $np: not every rank passed"
done
echo "wsync_mpi: all checks passed"
