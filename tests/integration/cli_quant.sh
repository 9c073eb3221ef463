#!/usr/bin/env bash
# Black-box checks of `fp4rollout quant`: round trips against known values,
# and clear errors (non-zero exit, nothing written) on bad input.
set -euo pipefail
name=cli_quant
source "$(dirname "$0")/cli_setup.bash"

# One NVFP4 block: amax 6 -> scale E4M3(1) = 1, so every value is its own E2M1
# rounding: 0.25 -> 0 and 0.75 -> 1 (ties to even), 5 -> 4, 7 -> 6 (saturated).
$py - "$dir/in.f32" <<'PY'
import struct, sys
vals = [6, 0.25, 0.75, 5, -1.25, 2.5, 3.5, -0.5, 1.75, 0, 0, 0, 0, 0, 0, 0.1]
open(sys.argv[1], "wb").write(struct.pack("<16f", *vals))
PY
"$bin" quant --format nvfp4 --dim 16 "$dir/in.f32" "$dir/out.f32"
got=$($py -c "import struct,sys; print(' '.join('%g' % v for v in struct.unpack('<16f', open(sys.argv[1],'rb').read())))" "$dir/out.f32")
want="6 0 1 4 -1 2 4 -0.5 2 0 0 0 0 0 0 0"
[ "$got" = "$want" ] || fail "nvfp4 block: got '$got', want '$want'"

# --dual reconstructs a smooth row better than a single quantization.
$py - "$dir/row.f32" <<'PY'
import math, struct, sys
open(sys.argv[1], "wb").write(struct.pack("<128f", *[math.sin(0.37 * i) * (1 + i % 7) for i in range(128)]))
PY
for fmt in nvfp4 mxfp4; do
  "$bin" quant --format $fmt --dim 128 "$dir/row.f32" "$dir/single.f32"
  "$bin" quant --format $fmt --dim 128 --dual --scale-search "$dir/row.f32" "$dir/dual.f32"
  $py - "$dir/row.f32" "$dir/single.f32" "$dir/dual.f32" <<'PY' || fail "$fmt: dual not better than single"
import struct, sys
r = [struct.unpack("<128f", open(p, "rb").read()) for p in sys.argv[1:]]
err = lambda a: sum((x - y) ** 2 for x, y in zip(a, r[0]))
sys.exit(0 if err(r[2]) < 0.1 * err(r[1]) else 1)
PY
done

# Bad input: each must exit non-zero with a message and leave OUT absent.
expect_error() {
  local pattern=$1; shift
  rm -f "$dir/bad.out"
  if "$bin" quant "$@" 2>"$dir/err"; then fail "accepted: $*"; fi
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
  [ ! -e "$dir/bad.out" ] || fail "output written for: $*"
}
head -c 60 "$dir/in.f32" > "$dir/short.f32"
expect_error "not a multiple of 64" --format nvfp4 --dim 16 "$dir/short.f32" "$dir/bad.out"
expect_error "block size 32" --format mxfp4 --dim 16 "$dir/in.f32" "$dir/bad.out"
expect_error "unknown FP4 format" --format fp3 --dim 16 "$dir/in.f32" "$dir/bad.out"
expect_error "--dim expects" --format nvfp4 --dim 0 "$dir/in.f32" "$dir/bad.out"
expect_error "--dim expects" --format nvfp4 --dim 12x "$dir/in.f32" "$dir/bad.out"
expect_error "--format is required" --dim 16 "$dir/in.f32" "$dir/bad.out"
expect_error "cannot read" --format nvfp4 --dim 16 "$dir/missing.f32" "$dir/bad.out"
expect_error "expected IN and OUT" --format nvfp4 --dim 16 "$dir/in.f32"
expect_error "unknown or ambiguous option" --format nvfp4 --dim 16 --frobnicate "$dir/in.f32" "$dir/bad.out"
{ out=$("$bin" quant --help) && grep -q "usage: fp4rollout quant" <<< "$out"; } || fail "--help"
{ out=$("$bin" demo --help) && grep -q "usage: fp4rollout demo" <<< "$out"; } || fail "demo --help"
{ out=$("$bin" --help) && grep -q "quant" <<< "$out"; } || fail "top-level --help"
echo "cli_quant: all checks passed"
