"""The project's source files, for the checks in scripts/ (run from the
repository root): git's list where there is a checkout (untracked files
count, ignored ones not), else every file below the root but build outputs."""
import os
import subprocess


def sources(exts):
    r = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'] + ['*' + e for e in exts],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return [f for f in r.stdout.split() if os.path.exists(f)]
    out = []
    for d, dirs, names in os.walk('.'):
        dirs[:] = sorted(x for x in dirs if not x.startswith('.') and not (d == '.' and x.startswith('build')))
        out += [os.path.normpath(os.path.join(d, n)) for n in sorted(names) if n.endswith(exts)]
    return out
