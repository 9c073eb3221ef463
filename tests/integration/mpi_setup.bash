# Sourced by the integration scripts that start mpirun (not a test itself:
# scripts/run-tests.sh runs only *.sh). Expects `name` set to the script's
# name. Defines bin, py, dir (a temporary folder removed at exit), fail,
# and run_np NP [LIMIT_S] ARGS... which runs build/fp4rollout on NP ranks;
# exits 0 with a SKIP line when mpirun is absent.
bin=${BUILD:-build}/fp4rollout
py=/usr/bin/python3
fail() { echo "$name: $*" >&2; exit 1; }
if ! command -v mpirun >/dev/null 2>&1; then
  echo "$name: SKIP: mpirun not found (install openmpi-bin: scripts/install-deps.sh)"
  exit 0
fi
[ -x "$bin" ] || fail "$bin is missing (run make)"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# One BLAS thread per rank: ranks share few cores (--oversubscribe).
export OPENBLAS_NUM_THREADS=1
mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
run_np() { local np=$1; shift; timeout "${mpi_limit:-300}" "${mpi[@]}" -np "$np" "$bin" "$@"; }
