"""The toy task: finish a one-line Python function so that it returns a value
of the type its annotation asks for.

A prompt is the head of a function and the start of its body,

    def <name>(<arg>: <argtype>) -> <rettype>:
        return 

and the model writes the return expression (generation stops at the newline).
The reward runs the function on a fixed argument of <argtype> in a sandboxed
subprocess and is 1 when the value's exact type is <rettype>, else 0.

With shots > 0 the prompt starts with that many solved examples (functions
of the same form with a correct return line, drawn from SHOTS), which raises
the base rate and lengthens the context past the first 128-token KV page.

Tokens are bytes: BOS (256), then one token per byte of the prompt.
"""
import concurrent.futures
import json
import os
import random
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile

BOS, EOS, NEWLINE = 256, 257, 10

ARG_TYPES = {   # annotation -> (argument names, the value the function is called with)
    "int": (["n", "x", "k", "count", "value"], "7"),
    "str": (["s", "text", "name", "word", "line"], "'hello world'"),
    "list": (["xs", "items", "values", "data", "nums"], "[3, 1, 2]"),
}
RET_TYPES = ["int", "str", "bool", "list", "float", "tuple", "dict"]
NAMES = ["f", "g", "helper", "compute", "convert", "process", "transform", "make", "get_value", "apply"]

# Solved examples for the few-shot preamble: return type -> (argument type,
# return expression with {a} for the argument). Each one is correct.
SHOTS = {
    "int": [("list", "len({a})"), ("str", "len({a})"), ("int", "{a} * 2"), ("list", "sum({a})")],
    "str": [("int", "str({a})"), ("str", "{a}.upper()"), ("list", "', '.join(map(str, {a}))"), ("int", "'#' * {a}")],
    "bool": [("int", "{a} > 0"), ("str", "{a}.startswith('a')"), ("list", "len({a}) == 0"), ("int", "{a} % 2 == 0")],
    "list": [("str", "{a}.split()"), ("int", "list(range({a}))"), ("list", "sorted({a})"), ("str", "list({a})")],
    "float": [("int", "{a} / 2"), ("list", "sum({a}) / len({a})"), ("str", "float(len({a}))"), ("int", "float({a})")],
    "tuple": [("list", "tuple({a})"), ("int", "({a}, {a} + 1)"), ("str", "tuple({a}.split())"),
              ("list", "(min({a}), max({a}))")],
    "dict": [("str", "{{{a}: len({a})}}"), ("list", "dict(enumerate({a}))"), ("int", "{{'value': {a}}}"),
             ("str", "dict.fromkeys({a}, 0)")],
}


def head(name, arg, argtype, rettype):
    return f"def {name}({arg}: {argtype}) -> {rettype}:\n    return "


class Prompt:
    """One task instance: `head` is the function to finish, `text` the whole
    prompt (the shots, then the head), `token_ids` BOS + its bytes."""

    def __init__(self, name, arg, argtype, rettype, shots=""):
        self.name, self.arg, self.argtype, self.rettype = name, arg, argtype, rettype
        self.head = head(name, arg, argtype, rettype)
        self.text = shots + self.head
        self.token_ids = [BOS] + list(self.text.encode())

    def key(self):
        return (self.name, self.arg, self.argtype, self.rettype)


class TypeTask:
    """Draws prompts from the 10 x 15 x 7 = 1050 combinations of name, argument
    and types, uniformly over the return type, each after `shots` solved
    examples of other functions (random return types)."""

    def __init__(self, seed=0, shots=0):
        self.rng = random.Random(seed)
        self.shots = shots

    def _shots(self):
        out = []
        for _ in range(self.shots):
            rettype = self.rng.choice(RET_TYPES)
            argtype, expr = self.rng.choice(SHOTS[rettype])
            arg = self.rng.choice(ARG_TYPES[argtype][0])
            out.append(head(self.rng.choice(NAMES), arg, argtype, rettype) + expr.format(a=arg) + "\n\n\n")
        return "".join(out)

    def sample(self, count):
        out = []
        for _ in range(count):
            shots = self._shots()
            argtype = self.rng.choice(sorted(ARG_TYPES))
            out.append(Prompt(self.rng.choice(NAMES), self.rng.choice(ARG_TYPES[argtype][0]), argtype,
                              self.rng.choice(RET_TYPES), shots))
        return out


def completion_text(token_ids):
    """The return expression a response spells: its bytes up to the first
    newline or EOS (other special tokens are dropped)."""
    out = bytearray()
    for t in token_ids:
        if t in (NEWLINE, EOS):
            break
        if t < 256:
            out.append(t)
    return out.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- sandbox

# Runs inside the child (python3 -I -S): reads {"src", "call", "want", "nonce"}
# from stdin, forbids process, network, file-writing and frame-inspection
# events with an audit hook, runs the function and prints the nonce and the
# verdict on the last line.
_CHILD = r'''
import json, sys
def _main():
    spec = json.loads(sys.stdin.read())
    nonce, want = spec["nonce"], spec["want"]
    blocked = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.kill", "os.remove", "os.rename", "os.rmdir", "os.unlink", "os.mkdir", "os.chmod", "os.chown",
               "os.truncate", "os.symlink", "os.link", "shutil.", "ctypes.", "urllib.", "sys._getframe",
               "sys._current_frames", "object.__getattr__", "sys.settrace", "sys.setprofile", "os.putenv",
               "os.chdir", "mmap.", "fcntl.", "resource.")
    def hook(event, args):
        if event.startswith(blocked):
            raise RuntimeError("blocked: " + event)
        if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
            raise RuntimeError("blocked: open for writing")
    env = {"__name__": "candidate", "__builtins__": __builtins__}
    sys.addaudithook(hook)
    verdict = {"ok": False, "type": None, "error": None}
    try:
        exec(compile(spec["src"], "<candidate>", "exec"), env)
        value = env[spec["fn"]](eval(spec["call"], {}))
        verdict["type"] = type(value).__name__
        verdict["ok"] = type(value).__name__ == want and type(value).__module__ == "builtins"
    except BaseException as e:
        verdict["error"] = type(e).__name__
    sys.stdout.write("\n" + nonce + json.dumps(verdict) + "\n")
    sys.stdout.flush()
_main()
'''

_NET_PREFIX = None


def _net_prefix():
    """['unshare', '-rn'] when a new (empty) network namespace can be made here,
    else [] (the audit hook still blocks sockets)."""
    global _NET_PREFIX
    if _NET_PREFIX is None:
        _NET_PREFIX = []
        exe = shutil.which("unshare")
        if exe:
            try:
                r = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5)
                if r.returncode == 0:
                    _NET_PREFIX = [exe, "-rn"]
            except (OSError, subprocess.SubprocessError):
                pass
    return _NET_PREFIX


def _limits():
    resource.setrlimit(resource.RLIMIT_CPU, (2, 2))
    resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()


def run_candidate(prompt, expr, timeout_s=5.0):
    """The verdict dict ({ok, type, error}) of one completion, run in a fresh
    process in a fresh temporary folder, with CPU, memory, file-size and
    descriptor limits, no network namespace where possible, and a timeout."""
    src = prompt.head + expr + "\n"
    nonce = secrets.token_hex(16)
    spec = json.dumps({"src": src, "fn": prompt.name, "call": ARG_TYPES[prompt.argtype][1],
                       "want": prompt.rettype, "nonce": nonce})
    with tempfile.TemporaryDirectory(prefix="dapo-sandbox-") as tmp:
        cmd = _net_prefix() + [sys.executable, "-I", "-S", "-B", "-c", _CHILD]
        try:
            r = subprocess.run(cmd, input=spec.encode(), capture_output=True, timeout=timeout_s, cwd=tmp,
                               env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, preexec_fn=_limits)
        except subprocess.TimeoutExpired:
            return {"ok": False, "type": None, "error": "timeout"}
    lines = r.stdout.decode("utf-8", errors="replace").splitlines()
    if not lines or not lines[-1].startswith(nonce):
        return {"ok": False, "type": None, "error": f"no verdict (exit {r.returncode})"}
    return json.loads(lines[-1][len(nonce):])


class Scorer:
    """Scores (prompt, expression) pairs, several processes at a time, with a
    cache: the same expression for the same prompt is run once."""

    def __init__(self, jobs=4, timeout_s=5.0):
        self.jobs, self.timeout_s = jobs, timeout_s
        self.cache = {}

    def score(self, pairs):
        uncached = {}
        for p, e in pairs:
            k = (p.key(), e)
            if k not in self.cache and k not in uncached:
                uncached[k] = (p, e)
        if uncached:
            with concurrent.futures.ThreadPoolExecutor(self.jobs) as ex:
                futs = {k: ex.submit(run_candidate, p, e, self.timeout_s) for k, (p, e) in uncached.items()}
                for k, f in futs.items():
                    self.cache[k] = f.result()
        return [1.0 if self.cache[(p.key(), e)]["ok"] else 0.0 for p, e in pairs]


if __name__ == "__main__":
    # A quick self-check of the sandbox and the verdicts.
    p = Prompt("f", "x", "int", "str")
    cases = [("str(x)", True), ("x", False), ("f'{x}'", True), ("__import__('socket').socket()", False),
             ("open('out.txt', 'w')", False), ("[0] * 10**10", False), ("x +", False),
             ("__import__('os').system('echo hi')", False), ("sum(range(10**12))", False)]
    got = Scorer().score([(p, e) for e, _ in cases])
    for (e, want), g in zip(cases, got):
        print(f"{'ok ' if bool(g) == want else 'BAD'} {g:.0f} {e}")
    # Every shot of the preamble must pass its own check.
    shots = [(Prompt("f", ARG_TYPES[at][0][0], at, rt), e.format(a=ARG_TYPES[at][0][0]))
             for rt, lst in SHOTS.items() for at, e in lst]
    shot_ok = Scorer().score(shots)
    for (p, e), g in zip(shots, shot_ok):
        if not g:
            print(f"BAD shot {p.head!r}{e}")
    sys.exit(0 if all(bool(g) == w for (_, w), g in zip(cases, got)) and all(shot_ok) else 1)
