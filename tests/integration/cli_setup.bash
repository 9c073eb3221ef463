# Sourced by the cli_* integration scripts and by mpi_setup.bash (not a test
# itself: scripts/run-tests.sh runs only *.sh). Expects `name` set to the
# script's name. Defines bin (build/fp4rollout, or $cli_bin when set), py,
# dir (a temporary folder removed at exit), fail MESSAGE, and
# random_prompts FILE SEED N (N prompts of BOS 256 and 3 to 150 byte ids,
# the same for the same seed); checks that the binary is built.
bin=${cli_bin:-${BUILD:-build}/fp4rollout}
py=${FR_PYTHON:-/usr/bin/python3}   # FR_PYTHON: another interpreter with numpy (a GPU machine's)
fail() { echo "$name: $*" >&2; exit 1; }
[ -x "$bin" ] || fail "$bin is missing (run make)"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

random_prompts() {
  $py - "$@" <<'PY'
import random, sys
random.seed(int(sys.argv[2]))
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[3])):
        n = random.randint(3, 150)
        f.write(",".join(["256"] + [str(random.randint(0, 255)) for _ in range(n)]) + "\n")
PY
}
