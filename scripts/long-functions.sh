#!/usr/bin/env bash
# Lists the C functions longer than a limit (default 150 lines, the
# project's rule outside CUDA kernels): "LINES file:line name", longest
# first; exits 1 when there is one. CUDA sources (*.cu, *.cuh) are left
# out: kernels and their launch code are checked by review. A function is
# what the project's style makes it: a definition whose body opens with "{"
# alone at the start of a line and closes with "}" at the start of a line.
# Usage: scripts/long-functions.sh [LIMIT]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "${1:-150}" <<'PY'
import os, re, sys
sys.path.insert(0, 'scripts')
from source_files import sources
limit = int(sys.argv[1])
files = sources(('.c', '.h'))
name = re.compile(r'(\w+)\s*\([^;]*$')
found = []
for f in files:
    try:
        lines = open(f, encoding='utf-8', errors='replace').read().split('\n')
    except FileNotFoundError:
        continue
    i = 0
    while i < len(lines):
        if lines[i] == '{' and i > 0:
            # the signature: back to the line that starts at column 0
            j = i - 1
            while j > 0 and (lines[j].startswith(' ') or lines[j].startswith('\t')):
                j -= 1
            m = name.search(' '.join(lines[j:i]).split('(')[0] + '(')
            k = i + 1
            while k < len(lines) and lines[k] != '}':
                k += 1
            n = k - j + 1
            if m and n > limit:
                found.append((n, f'{f}:{j + 1}', m.group(1)))
            i = k
        i += 1
for n, where, fn in sorted(found, reverse=True):
    print(f'{n:5d} {where} {fn}')
sys.exit(1 if found else 0)
PY
