#!/usr/bin/env bash
# Black-box checks of `fp4rollout generate` and `score` on the built-in
# synthetic model: JSON output, seed reproducibility, n samples, every KV
# dtype, clear errors for invalid requests, and the exit statuses of the
# command-line convention across commands (2 usage, 1 runtime, with the
# option or file named).
set -euo pipefail
name=cli_generate
source "$(dirname "$0")/cli_setup.bash"

gen() { "$bin" generate --model synthetic:tiny --prompt-ids 256,1,2,3 "$@"; }

gen --n 3 --max-tokens 12 --temperature 0.9 --top-p 0.95 --seed 7 --json > "$dir/a.jsonl"
gen --n 3 --max-tokens 12 --temperature 0.9 --top-p 0.95 --seed 7 --json > "$dir/b.jsonl"
cmp -s "$dir/a.jsonl" "$dir/b.jsonl" || fail "same seed gave different samples"
gen --n 3 --max-tokens 12 --temperature 0.9 --top-p 0.95 --seed 8 --json > "$dir/c.jsonl"
cmp -s "$dir/a.jsonl" "$dir/c.jsonl" && fail "different seeds gave identical samples"
$py - "$dir/a.jsonl" <<'PY' || fail "JSON lines malformed"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["sample"] for r in rows] == [0, 1, 2]
for r in rows:
    assert len(r["token_ids"]) == len(r["logprobs"]) >= 1
    assert r["finish_reason"] in ("stop", "length")
    assert r["finish_reason"] == "stop" or len(r["token_ids"]) == 12
    assert all(lp <= 0 and math.isfinite(lp) for lp in r["logprobs"])
PY

# Every KV dtype and recipe runs through the decode path past one page.
for kv in bf16 fp8 nvfp4 mxfp4; do
  for recipe in full vanilla; do
    gen --kv $kv --recipe $recipe --max-tokens 140 --greedy --ignore-eos --json > "$dir/g.json" ||
      fail "generate --kv $kv --recipe $recipe failed"
  done
done

# score: prefill and decode paths write [tokens][vocab] float32.
"$bin" score --model synthetic:tiny --prompt-ids 256,5,6,7,8 --out "$dir/s.f32"
"$bin" score --model synthetic:tiny --prompt-ids 256,5,6,7,8 --decode --kv nvfp4 --out "$dir/d.f32"
[ "$(stat -c %s "$dir/s.f32")" -eq $((5 * 272 * 4)) ] || fail "score output size"
[ "$(stat -c %s "$dir/d.f32")" -eq $((5 * 272 * 4)) ] || fail "score --decode output size"

expect_error() {
  local pattern=$1; shift
  if "$bin" "$@" >/dev/null 2>"$dir/err"; then fail "accepted: $*"; fi
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
}
expect_error "outside the vocabulary" generate --prompt-ids 256,272
expect_error "--prompt-ids needs at least one token id" generate --prompt-ids ""
expect_error "cannot start with a comma" generate --prompt-ids ","
expect_error "empty entry" generate --prompt-ids 256,1,,2
expect_error "exceeds the context window" generate --prompt-ids "$(seq -s, 1 4096 | sed 's/[0-9]\+/5/g')"
expect_error "--max-tokens expects" generate --max-tokens 0
expect_error "--max-tokens expects" generate --max-tokens -3
expect_error "--n expects" generate --n 0
expect_error "unknown kv dtype" generate --kv int4
expect_error "recipe switch" generate --recipe full,rotate
expect_error "--top-p expects a number in (0, 1\]" generate --temperature 1 --top-p 1.5
expect_error "no such checkpoint folder" generate --model /nonexistent/dir
expect_error "--out is required" score --prompt-ids 256,1
expect_error "not a non-negative integer" score --prompt-ids 256,x --out "$dir/x"
for c in generate score; do { out=$("$bin" $c --help) && grep -q "usage: fp4rollout $c" <<< "$out"; } || fail "$c --help"; done

# Conventions: --opt=value equals --opt value; usage errors exit 2, runtime
# errors 1; --version; text prompts for byte-level models.
gen --max-tokens=6 --seed=3 --temperature=0.7 --json > "$dir/eq.json"
gen --max-tokens 6 --seed 3 --temperature 0.7 --json > "$dir/sp.json"
cmp -s "$dir/eq.json" "$dir/sp.json" || fail "--opt=value and --opt value differ"
status() { set +e; "$bin" "$@" >/dev/null 2>&1; echo $?; set -e; }
for bad in "generate --bogus" "generate --max-tokens" "generate --greedy=1" "score --out" "rollout --max-seqs=x" \
           "serve --port" "calibrate --tau-steps=-1" "eval-kl --tokens 0" "quant --dim=0" "demo --seed=q" \
           "generate --log-level loud" "nosuchcommand"; do
  [ "$(status $bad)" = 2 ] || fail "'$bad' did not exit 2"
done
[ "$(status generate --model /nonexistent/dir)" = 1 ] || fail "a missing model did not exit 1"
# Every command the same way: a bad value is a usage error (2) whose
# message names the option and the reason, found before any work starts; a
# file that cannot be read or a model that cannot load is a runtime
# failure (1) with the system's reason.
expect_status() {
  local want=$1 pattern=$2; shift 2
  set +e; "$bin" "$@" > /dev/null 2> "$dir/err"; local rc=$?; set -e
  [ "$rc" = "$want" ] || fail "exit $rc, not $want, for: $* ($(cat "$dir/err"))"
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
}
expect_status 2 "--temperature expects a number in \[0, 1e+06\], got '-1'" generate --temperature -1
expect_status 2 "--top-k expects an integer in \[0, 1073741824\], got '-1'" generate --top-k -1
expect_status 2 "--prompt-ids needs at least one token id" generate --prompt-ids ""
expect_status 2 "--prompt-ids: token ids: an empty entry after id 256" generate --prompt-ids 256,,3
expect_status 2 "outside the vocabulary" generate --model synthetic:tiny --prompt-ids 256,272
expect_status 2 "--top-p expects a number in (0, 1\]" rollout --prompts "$dir/none.txt" --top-p 0
expect_status 2 "--max-num-seqs expects an integer in \[1, 65536\], got '0'" serve --max-num-seqs 0
expect_status 2 "--min-tokens 9 exceeds --max-tokens 8" generate --min-tokens 9 --max-tokens 8
expect_status 2 "--prompts is required" rollout --n 2
expect_status 1 "cannot read /nonexistent: No such file or directory" rollout --prompts /nonexistent
expect_status 1 "cannot read /nonexistent: No such file or directory" generate --prompt-file /nonexistent
expect_status 1 "cannot read /nonexistent: No such file or directory" score --prompt-file /nonexistent --out "$dir/x"
expect_status 1 "cannot read config file /nonexistent" serve --config /nonexistent
expect_status 1 "no such checkpoint folder" eval-kl --model /nonexistent/dir --texts "$dir/none.txt"
"$bin" --version | grep -Eq '^fp4rollout [0-9]+\.[0-9]+\.[0-9]+$' || fail "--version"
"$bin" generate --model=synthetic:tiny --prompt "hello" --max-tokens=3 --greedy --seed=1 --json > "$dir/t.json"
"$bin" generate --model=synthetic:tiny --prompt-ids 256,104,101,108,108,111 --max-tokens=3 --greedy --seed=1 --json > "$dir/i.json"
cmp -s "$dir/t.json" "$dir/i.json" || fail "--prompt hello is not BOS and its bytes"
"$bin" generate --model synthetic:tiny --prompt hi --max-tokens 2 --log-level=debug 2>&1 >/dev/null |
  grep -Eq '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z ' || fail "no timestamped log line"
echo "cli_generate: all checks passed"
