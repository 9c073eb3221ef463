#!/usr/bin/env bash
# comm/ across processes: runs the comm unit test (tests/unit/test_comm.c)
# under mpirun with 2 and 4 ranks, so its collectives sum, gather and
# broadcast real data and the world splits into engines of tp 2. Skipped,
# with a message, when mpirun is absent.
set -euo pipefail
name=comm_mpi cli_bin=${BUILD:-build}/tests/test_comm
source "$(dirname "$0")/mpi_setup.bash"

for np in 2 4; do mpi_unit_test "$np" 120 "test_comm: $np rank(s)"; done
echo "comm_mpi: all checks passed"
