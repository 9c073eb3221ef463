# Sourced by the tests of the PyTorch examples (examples/dapo) after setting
# `name`: serve_setup.bash's helpers, then tq6 (the checkpoint folder, made
# absolute) and ex (examples/dapo). Skips the test (exit 0, with a message)
# without python3-torch, python3-matplotlib or the tq6 checkpoint
# (../shared/models/tq6, or $TQ6); fails when the client library is not built.
source "$(dirname "${BASH_SOURCE[0]}")/serve_setup.bash"
tq6=${TQ6:-../shared/models/tq6}
ex=examples/dapo

$py -c 'import torch' 2>/dev/null || { echo "$name: SKIP: python3-torch is missing (scripts/install-deps.sh)"; exit 0; }
$py -c 'import matplotlib' 2>/dev/null ||
  { echo "$name: SKIP: python3-matplotlib is missing (scripts/install-deps.sh)"; exit 0; }
[ -f "$tq6/config.json" ] || { echo "$name: SKIP: the tq6 checkpoint is absent ($tq6)"; exit 0; }
[ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"
tq6=$(cd "$tq6" && pwd)
