#!/usr/bin/env bash
# The retrieval task generator and the training script's data pipeline
# (models/retrieval/), which need no PyTorch: tests/integration/retrieval_tasks.py;
# and that the training script compiles (retrieval_train.sh trains with it).
set -euo pipefail
py=/usr/bin/python3
export PYTHONDONTWRITEBYTECODE=1   # nothing written into the source tree
$py tests/integration/retrieval_tasks.py
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$py -c 'import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)' \
  models/retrieval/train_retrieval.py "$tmp/train_retrieval.pyc"
echo "retrieval_tasks: ok"
