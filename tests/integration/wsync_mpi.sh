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
name=wsync_mpi cli_bin=${BUILD:-build}/tests/test_wsync_rank
source "$(dirname "$0")/mpi_setup.bash"

for np in 3 5; do
  mpi_unit_test "$np" 300 "test_wsync_rank: $((np - 1)) server ranks, all-or-nothing checked"
done
echo "wsync_mpi: all checks passed"
