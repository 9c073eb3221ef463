#!/usr/bin/env bash
# fp4rollout eval-task on the CPU with the demo model: the expected answers
# are the model's own greedy continuations recorded first with `generate`
# (up to their first newline), so the bf16 configuration must answer every
# prompt; the table and the JSON lines are checked (cells, Wilson bounds,
# paired counts); a file from models/retrieval/retrieval_tasks.py runs
# through as it is; and the refusals: a missing file, a bad JSON line named
# by its number, an unknown configuration, no --tasks.
set -euo pipefail
name=cli_eval_task
source "$(dirname "$0")/cli_setup.bash"
model=models/demo

# Greedy continuations in deterministic mode: eval-task's batches cannot
# change them (docs/determinism.md).
prompts=("def " "import os" "class Config:\n    def __init__(self" "    return " "for i in range(" "from " \
         "if __name__ == " "x = ")
: > "$dir/recorded.jsonl"
for p in "${prompts[@]}"; do
  "$bin" generate --model "$model" --prompt "$(printf "$p")" --greedy --max-tokens 48 --stop $'\n' --json \
    --deterministic --log-level off >> "$dir/recorded.jsonl"
done
$py - "$dir/recorded.jsonl" "$dir/tasks.jsonl" "${prompts[@]}" <<'PY' || fail "could not build the task file"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
prompts = [p.encode().decode("unicode_escape") for p in sys.argv[3:]]
with open(sys.argv[2], "w") as f:
    kept = 0
    for i, (p, r) in enumerate(zip(prompts, rows)):
        # A continuation that ran out of tokens before a newline has no one-line answer.
        if r["finish_reason"] != "stop" or not r["text"].strip(" \t\r"):
            continue
        f.write(json.dumps({"prompt": p, "answer": r["text"], "variant": "ab"[i % 2], "context": 16 * (1 + i % 2),
                            "index": i}) + "\n")
        kept += 1
assert kept >= 4, "only %d of %d greedy continuations ended in a newline" % (kept, len(prompts))
PY
n=$(wc -l < "$dir/tasks.jsonl")

"$bin" eval-task --model "$model" --tasks "$dir/tasks.jsonl" --kv bf16,f32,nvfp4-vanilla --deterministic --json \
  > "$dir/out.jsonl" 2> "$dir/err" || fail "eval-task failed: $(cat "$dir/err")"
grep -q "eval-task: bf16: $n/$n prompts, $n exact" "$dir/err" || fail "no progress on stderr: $(cat "$dir/err")"
$py - "$dir/out.jsonl" "$n" <<'PY' || fail "JSON report wrong: $(cat "$dir/out.jsonl")"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
n = int(sys.argv[2])
assert [r["config"] for r in rows] == ["bf16"] * 3 + ["f32"] * 3 + ["nvfp4-vanilla"] * 3, rows
assert [(r["variant"], r["context"]) for r in rows[:3]] == [("a", 16), ("b", 32), ("all", None)]
for r in rows:
    assert r["baseline"] == "bf16"
    assert r["exact"] <= r["n"] and abs(r["accuracy"] - r["exact"] / r["n"]) < 1e-6
    lo, hi = r["ci95"]
    assert 0 <= lo <= r["accuracy"] <= hi <= 1
    assert abs(r["diff"] - (r["c"] - r["b"]) / r["n"]) < 1e-6 and 0 < r["p_mcnemar"] <= 1
    assert r["seconds"] >= 0
    if r["config"] == "bf16":
        assert r["exact"] == r["n"] and r["b"] == r["c"] == 0 and r["p_mcnemar"] == 1, r
    # Every wrong answer of a configuration is a pair the baseline won.
    assert r["b"] == r["n"] - r["exact"] and r["c"] == 0, r
alls = [r for r in rows if r["variant"] == "all"]
assert all(r["n"] == n for r in alls)
assert sum(r["n"] for r in rows[:2]) == n
# n = 4..8 prompts all right: the Wilson lower bound is n / (n + z^2).
z2 = 1.959963984540054 ** 2
assert abs(alls[0]["ci95"][0] - n / (n + z2)) < 1e-5, alls[0]
PY

# The table: a header, then a row per configuration and cell.
# bench/plot_eval_task.py draws the report (two variants, two contexts: curves), and refuses other JSON
if $py -c 'import matplotlib' 2>/dev/null; then
  $py bench/plot_eval_task.py "$dir/out.jsonl" --out "$dir/acc.png" --title t > /dev/null ||
    fail "plot_eval_task.py on the report failed"
  [ "$(head -c 4 "$dir/acc.png" | tail -c 3)" = PNG ] || fail "plot_eval_task.py wrote no PNG"
  ! $py bench/plot_eval_task.py "$dir/tasks.jsonl" --out "$dir/bad.png" 2> "$dir/plot.err" && [ ! -f "$dir/bad.png" ] &&
    grep -q "line 1: not an eval-task JSON line" "$dir/plot.err" || fail "plot_eval_task.py took a task file: $(cat "$dir/plot.err")"
else
  echo "cli_eval_task: plot_eval_task.py not checked: python3-matplotlib is missing"
fi
"$bin" eval-task --model "$model" --tasks "$dir/tasks.jsonl" --kv bf16,nvfp4 --quiet > "$dir/table.md" 2> "$dir/err" ||
  fail "eval-task (table) failed: $(cat "$dir/err")"
grep -q "^| configuration | variant | context | n | exact | accuracy % | 95% CI % | vs bf16 (pp) | b / c | p |$" \
  "$dir/table.md" || fail "table header: $(cat "$dir/table.md")"
grep -q "^| bf16 | all | all | $n | $n | 100.0 |" "$dir/table.md" || fail "bf16 row: $(cat "$dir/table.md")"
[ "$(grep -c '^| nvfp4 |' "$dir/table.md")" -eq 3 ] || fail "nvfp4 rows: $(cat "$dir/table.md")"
grep -q "eval-task:" "$dir/err" && fail "--quiet printed progress: $(cat "$dir/err")"

# A file of the retrieval generator goes through as it is (the demo model
# was not trained on it: only the format and the cells are checked).
$py models/retrieval/retrieval_tasks.py --out "$dir/retrieval.jsonl" --n 2 --contexts 400 --seed 3
"$bin" eval-task --model "$model" --tasks "$dir/retrieval.jsonl" --kv bf16,mxfp4 --json --quiet \
  > "$dir/r.jsonl" || fail "eval-task on the generator's file failed"
$py - "$dir/r.jsonl" <<'PY' || fail "cells of the generator's file: $(cat "$dir/r.jsonl")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cells = [(r["config"], r["variant"], r["context"], r["n"]) for r in rows]
want = [(c, v, x, k) for c in ("bf16", "mxfp4") for v, x, k in
        (("single", 400, 2), ("multikey", 400, 2), ("vartrack", 400, 2), ("all", None, 6))]
assert cells == want, cells
PY

expect() {
  local status=$1 pattern=$2; shift 2
  set +e
  "$bin" eval-task "$@" > /dev/null 2> "$dir/err"
  local rc=$?
  set -e
  [ $rc -eq "$status" ] || fail "exit $rc (want $status) for: $* ($(cat "$dir/err"))"
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
}
expect 1 "cannot read $dir/none.jsonl: No such file" --model "$model" --tasks "$dir/none.jsonl"
{ head -1 "$dir/tasks.jsonl"; echo '{"prompt": "x", "answer": '; } > "$dir/bad.jsonl"
expect 1 "$dir/bad.jsonl line 2: not a JSON object" --model "$model" --tasks "$dir/bad.jsonl"
printf '{"prompt": "x", "answer": "y", "variant": "v"}\n' > "$dir/noctx.jsonl"
expect 1 "line 1: \"context\" must be a whole number" --model "$model" --tasks "$dir/noctx.jsonl"
expect 2 "unknown configuration 'nvfp5'" --model "$model" --tasks "$dir/tasks.jsonl" --kv bf16,nvfp5
expect 2 "--tasks" --model "$model"
echo "cli_eval_task: ok ($n prompts)"
