#!/usr/bin/env bash
# The cost of divergence monitoring on decode throughput: the same rollout
# (continuous-batching scheduler, `fp4rollout rollout`) with each
# --kl-sample-rate, the rates taken in turn ROUNDS times so drift on the
# machine hits every rate alike, then a markdown table of tokens/s per run,
# their mean and the ratio to rate 0.
#
# usage: bench/monitor_cost.sh [options] [-- rollout options...]
#   --rates LIST     comma-separated rates (default 0,0.0625); 0 is the baseline
#   --rounds N       runs of each rate (default 2)
#   --build DIR      build folder (default build)
#   --timeout S      limit of one run in seconds (default 120)
#   --out DIR        keep each run's samples and stats line there (default: a
#                    temporary folder, removed)
# Everything after -- goes to every `fp4rollout rollout` call (model, backend,
# KV dtype, prompts, n, max tokens, sampling); --prompts is required there.
set -euo pipefail
rates=0,0.0625 rounds=2 build=build limit=120 out=
while [ $# -gt 0 ]; do
  case $1 in
    --rates) rates=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) echo "monitor_cost: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
bin=$build/fp4rollout
[ -x "$bin" ] || { echo "monitor_cost: $bin is missing (run make)" >&2; exit 1; }
case " $* " in *" --prompts "*) ;; *) echo "monitor_cost: pass the rollout's --prompts after --" >&2; exit 2 ;; esac
keep=1
[ -n "$out" ] || { out=$(mktemp -d); keep=0; }
mkdir -p "$out"
[ $keep -eq 1 ] || trap 'rm -rf "$out"' EXIT
IFS=, read -r -a rate_list <<< "$rates"
declare -A tps
for ((r = 1; r <= rounds; r++)); do
  for rate in "${rate_list[@]}"; do
    log=$out/rate${rate}_run$r
    echo "monitor_cost: round $r/$rounds, rate $rate" >&2
    if ! timeout "$limit" "$bin" rollout "$@" --kl-sample-rate "$rate" --json > "$log.jsonl" 2> "$log.err"; then
      echo "monitor_cost: the run at rate $rate failed or passed ${limit} s:" >&2
      tail -5 "$log.err" >&2
      exit 1
    fi
    line=$(grep '^rollout: ' "$log.err" | tail -1)
    t=$(sed -n 's/.* tokens\/s \([0-9.]*\).*/\1/p' <<< "$line")
    [ -n "$t" ] || { echo "monitor_cost: no stats line at rate $rate" >&2; exit 1; }
    tps[$rate]="${tps[$rate]:-} $t"
    echo "$line" >&2
  done
done
echo "| kl_sample_rate | tokens/s (each run) | mean | against rate 0 |"
echo "|---|---|---|---|"
base=
for rate in "${rate_list[@]}"; do
  mean=$(awk '{s = 0; for (i = 1; i <= NF; i++) s += $i; printf "%.1f", s / NF}' <<< "${tps[$rate]}")
  [ "$rate" = 0 ] && base=$mean
  ratio=$( [ -n "$base" ] && awk -v a="$mean" -v b="$base" 'BEGIN {printf "%.3f", a / b}' || echo "-")
  echo "| $rate |${tps[$rate]// /, } | $mean | $ratio |" | sed 's/|, /| /'
done
