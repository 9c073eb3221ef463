# Sourced by the integration scripts that start mpirun (not a test itself:
# scripts/run-tests.sh runs only *.sh). Expects `name` set to the script's
# name; exits 0 with a SKIP line when mpirun is absent. Defines what
# cli_setup.bash defines (bin is $cli_bin when set: a test binary), and
# run_np NP [LIMIT_S] ARGS... which runs $bin on NP ranks, and
# mpi_unit_test NP LIMIT_S LINE which runs $bin, a cmocka test, on NP ranks
# and fails unless every rank passes and the output holds LINE.
if ! command -v mpirun >/dev/null 2>&1; then
  echo "$name: SKIP: mpirun not found (install openmpi-bin: scripts/install-deps.sh)"
  exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/cli_setup.bash"

# One BLAS thread per rank: ranks share few cores (--oversubscribe); root
# needs --allow-run-as-root.
export OPENBLAS_NUM_THREADS=1
mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
run_np() { local np=$1; shift; timeout "${mpi_limit:-300}" "${mpi[@]}" -np "$np" "$bin" "$@"; }

mpi_unit_test() {
  local np=$1 limit=$2 line=$3
  if ! timeout "$limit" "${mpi[@]}" -np "$np" "$bin" > "$dir/out" 2>&1; then
    tail -40 "$dir/out" >&2
    fail "$(basename "$bin") failed under mpirun -np $np"
  fi
  grep -q "$line" "$dir/out" || fail "-np $np: no line '$line' in the output: $(head -5 "$dir/out")"
  [ "$(grep -c "PASSED" "$dir/out")" -eq "$np" ] || fail "-np $np: not every rank passed"
}
