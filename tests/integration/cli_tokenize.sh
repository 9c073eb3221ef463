#!/usr/bin/env bash
# Black-box checks of `fp4rollout tokenize` and `fp4rollout detokenize`:
# ids the golden files record for the repository's SentencePiece-style
# tokenizer (and Qwen3's, when ../shared holds it), round trips through
# files and standard input, and exit status 2 / 1 with a message on bad
# usage and bad input.
set -euo pipefail
name=cli_tokenize
source "$(dirname "$0")/cli_setup.bash"
data=tests/data/tokenizer

# The golden ids of a corpus text, as the JSON line tokenize prints.
golden_line() {   # golden-name item key
  python3 -c 'import json, sys
g = json.load(open(sys.argv[1]))
print(json.dumps({"ids": g["items"][sys.argv[2]][sys.argv[3]]}))' "$data/golden/$1.json" "$2" "$3"
}

check_tokenizer() {   # golden-name tokenizer-path
  local golden=$1 tok=$2 item
  for item in en_plain emoji crlf chinese decomposed_accents llama_specials; do
    got=$("$bin" tokenize --tokenizer "$tok" --file "$data/corpus/$item.txt")
    [ "$got" = "$(golden_line "$golden" "$item" ids)" ] || fail "$golden $item: $got"
    got=$("$bin" tokenize --tokenizer "$tok" --file - --special < "$data/corpus/$item.txt")
    [ "$got" = "$(golden_line "$golden" "$item" ids_special)" ] || fail "$golden $item --special: $got"
  done
  # --text and --file agree; detokenize gives the text back (the SentencePiece
  # tokenizers strip the one leading space they add).
  text='Hello, wörld! 12345 你好 😀'
  ids=$("$bin" tokenize --tokenizer "$tok" --text "$text" | python3 -c 'import json, sys; print(",".join(map(str, json.load(sys.stdin)["ids"])))')
  [ -n "$ids" ] || fail "$golden: no ids for '$text'"
  back=$("$bin" detokenize --tokenizer "$tok" --ids "$ids")
  [ "$back" = "$text" ] || fail "$golden: detokenize gave '$back', want '$text'"
}

check_tokenizer spm_bpe "$data/spm_bpe"
check_tokenizer spm_bpe_metaspace "$data/spm_bpe_metaspace/tokenizer.json"
if [ -f ../shared/tokenizers/qwen3/tokenizer.json ]; then
  check_tokenizer qwen3 ../shared/tokenizers/qwen3
  got=$("$bin" detokenize --tokenizer ../shared/tokenizers/qwen3 --ids "151644 872 198 13048 151645" --skip-special)
  [ "$got" = "user"$'\n'"Hi" ] || fail "qwen3 --skip-special: '$got'"
else
  echo "cli_tokenize: SKIP the Qwen3 checks: ../shared/tokenizers/qwen3 not found"
fi

# <s> (id 1) with --special, and skipped by --skip-special.
got=$("$bin" tokenize --tokenizer "$data/spm_bpe" --text "" --special)
[ "$got" = '{"ids": [1]}' ] || fail "empty text with --special: $got"
got=$("$bin" tokenize --tokenizer "$data/spm_bpe" --text "")
[ "$got" = '{"ids": []}' ] || fail "empty text: $got"
got=$("$bin" detokenize --tokenizer "$data/spm_bpe" --ids 1,2 --skip-special)
[ -z "$got" ] || fail "special ids with --skip-special: '$got'"

expect_error() {   # status pattern args...
  local want=$1 pattern=$2; shift 2
  set +e; "$bin" "$@" >"$dir/out" 2>"$dir/err"; local rc=$?; set -e
  [ $rc -eq "$want" ] || fail "'$*' exited $rc, want $want: $(cat "$dir/err")"
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
  [ ! -s "$dir/out" ] || fail "'$*' printed to stdout: $(cat "$dir/out")"
}
printf 'ok \xc0\xaf' > "$dir/bad.txt"
expect_error 1 "not valid UTF-8" tokenize --tokenizer "$data/spm_bpe" --file "$dir/bad.txt"
expect_error 1 "cannot open" tokenize --tokenizer "$data/spm_bpe" --file "$dir/missing.txt"
expect_error 1 "no-such" tokenize --tokenizer "$dir/no-such" --text hi
echo '{"model": {"type": "WordPiece", "vocab": {"a": 0}}}' > "$dir/tokenizer.json"
expect_error 1 "WordPiece is not supported" tokenize --tokenizer "$dir" --text hi
expect_error 2 "--tokenizer is required" tokenize --text hi
expect_error 2 "one of --file and --text" tokenize --tokenizer "$data/spm_bpe"
expect_error 2 "one of --file and --text" tokenize --tokenizer "$data/spm_bpe" --text a --file b
expect_error 2 "--ids is required" detokenize --tokenizer "$data/spm_bpe"
expect_error 2 "empty entry" detokenize --tokenizer "$data/spm_bpe" --ids 1,,2
expect_error 2 "not a non-negative integer" detokenize --tokenizer "$data/spm_bpe" --ids 1,x
expect_error 2 "unknown or ambiguous option" tokenize --tokenizer "$data/spm_bpe" --frobnicate
{ out=$("$bin" tokenize --help) && grep -q "usage: fp4rollout tokenize" <<< "$out"; } || fail "tokenize --help"
{ out=$("$bin" detokenize --help) && grep -q "usage: fp4rollout detokenize" <<< "$out"; } || fail "detokenize --help"
{ out=$("$bin" --help) && grep -q "detokenize" <<< "$out"; } || fail "top-level --help"
echo "cli_tokenize: all checks passed"
