#!/usr/bin/env bash
# Checks the include graph against the layer rules of docs/architecture.md:
# every project #include "..." of a module's source must name a file of the
# module itself or of a module it may use, and no chain of includes may come
# back to where it started. Prints each violation and exits 1 when there is
# one; silent on success but for a one-line summary. Run by the test suite
# (scripts/run-tests.sh); `scripts/check-layers.sh --dot` prints the module
# graph in Graphviz's dot language instead.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, sys
sys.path.insert(0, 'scripts')
from source_files import sources

# module -> the modules it may use (besides itself). The order of
# docs/architecture.md's table; tests, benchmarks and examples may use all.
RULES = {
    'base': [],
    'attention': ['base'],
    'kvcache': ['base', 'attention'],
    'comm': ['base'],
    'tokenizer': ['base'],
    'rollout/model': ['base', 'attention', 'kvcache', 'comm'],
    'rollout/engine': ['base', 'attention', 'kvcache', 'comm', 'tokenizer', 'rollout/model'],
    'rollout/monitor': ['base', 'attention', 'kvcache', 'comm', 'tokenizer', 'rollout/model', 'rollout/engine'],
    'trainer_bridge/protocol': ['base'],
    'trainer_bridge/client': ['base', 'trainer_bridge/protocol', 'comm'],
    'trainer_bridge/server': ['base', 'trainer_bridge/protocol', 'comm', 'attention', 'kvcache', 'tokenizer',
                              'rollout/model', 'rollout/engine', 'rollout/monitor'],
    'trainer_bridge/http': ['base', 'trainer_bridge/protocol', 'comm', 'attention', 'kvcache', 'rollout/model',
                            'rollout/engine', 'rollout/monitor', 'trainer_bridge/server', 'tokenizer'],
    'app': None,   # everything
}
FREE = ('tests/', 'bench/', 'examples/')

def module_of(path):
    best = None
    for m in RULES:
        if path.startswith(m + '/') and (best is None or len(m) > len(best)):
            best = m
    return best

files = sources(('.c', '.h', '.cu', '.cuh'))
include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
edges = {}
bad = []
for f in files:
    targets = []
    for x in include.findall(open(f, encoding='utf-8', errors='replace').read()):
        local = os.path.normpath(os.path.join(os.path.dirname(f), x))
        t = local if os.path.exists(local) else x
        if not os.path.exists(t):
            continue   # a system or third-party header given in quotes
        targets.append(t)
        src, dst = module_of(f), module_of(t)
        if f.startswith(FREE) or src is None or dst is None or src == dst:
            continue
        if RULES[src] is not None and dst not in RULES[src]:
            bad.append(f'{f}: includes {x} ({dst}/), which {src}/ may not use')
    edges[f] = targets

# Cycles among files, by depth-first search (header guards would hide them
# from the compiler, not from a reader).
WHITE, GREY, BLACK = 0, 1, 2
color = {f: WHITE for f in edges}
cycles = []
def visit(f, stack):
    color[f] = GREY
    stack.append(f)
    for t in edges.get(f, []):
        if color.get(t, BLACK) == GREY:
            cycles.append(' -> '.join(stack[stack.index(t):] + [t]))
        elif color.get(t) == WHITE:
            visit(t, stack)
    stack.pop()
    color[f] = BLACK
sys.setrecursionlimit(10000)
for f in sorted(edges):
    if color[f] == WHITE:
        visit(f, [])

if '--dot' in sys.argv[1:]:
    pairs = sorted({(module_of(f), module_of(t)) for f, ts in edges.items() for t in ts
                    if module_of(f) and module_of(t) and module_of(f) != module_of(t)})
    print('digraph layers {')
    for a, b in pairs:
        print(f'  "{a}" -> "{b}";')
    print('}')
    sys.exit(0)
for b in bad:
    print('check-layers:', b)
for c in cycles:
    print('check-layers: include cycle:', c)
n = sum(len(t) for t in edges.values())
if bad or cycles:
    print(f'check-layers: {len(bad)} forbidden include(s), {len(cycles)} cycle(s)')
    sys.exit(1)
print(f'check-layers: {len(edges)} files, {n} project includes, no arrow against the layers, no cycle')
PY
