"""The long-reasoning task: column addition of many multi-digit numbers,
worked out digit by digit before the answer.

A prompt gives K numbers of D digits (the leading digit of each is 1-9),
column by column from the ones digit, one line per column:

    add 3 numbers of 4 digits, column by column from the ones:
    c00: 7 4 9
    c01: 0 2 5
    c02: 3 8 8
    c03: 1 6 2
    work:

and a worked solution takes the columns in order, writing the running sum
of the column's digits one addition at a time, then the carry coming in,
then the digit written and the carry going out:

    c00: 7+4=11 +9=20 +c0=20 => w0 c2
    c01: 0+2=2 +5=7 +c2=9 => w9 c0
    ...
    answer: 9790

Each column line must find its digits in the prompt line with the same
label (a lookup hundreds of tokens back), and the answer line reads the
written digits back from every column line in reverse order (the first one
the farthest back, about a line length times D tokens). These long-range
reads are where the precision of the KV cache matters. With the defaults
(K = 8, D = 20) a solution is about 1.3 KB (1.3K tokens: tokens are bytes)
and the prompt about 0.5 KB; the length grows linearly in D and about
linearly in K (`--self-check` prints a table).

Reward (`score`): 1 when the first line of the completion starting with
`answer:` holds exactly the sum, else 0. No format or partial credit: a
per-digit or per-line reward would pay for half-read columns and blur the
comparison of KV caches that the task is for, and the overlong penalty of
DAPO already shapes the length. `check` also reports, for diagnostics only,
whether the answer line was found and the share of column lines that are
exactly right.

Everything follows from a seed through random.Random seeded with a string
(the same stream on every platform). Standard library only.

    python3 arith_task.py --self-check
    python3 arith_task.py --operands 8 --digits 20 --show 1
"""
import argparse
import random
import sys

BOS, EOS = 256, 257
MAX_OPERANDS = 11   # keeps every carry one digit: 11 x 9 + 9 < 110


def column_line(j, digits, carry_in):
    """One solution line for column j: (text, digit written, carry out)."""
    total = digits[0]
    parts = []
    for d in digits[1:]:
        parts.append(f"+{d}={total + d}")
        total += d
    total += carry_in
    head = f"{digits[0]}" if len(digits) == 1 else f"{digits[0]}{parts[0]}"
    rest = parts[1:]
    text = f"c{j:02d}: " + " ".join([head] + rest + [f"+c{carry_in}={total}", f"=> w{total % 10} c{total // 10}"])
    return text + "\n", total % 10, total // 10


class ArithProblem:
    """One problem: `text` (the prompt), `token_ids` (BOS + its bytes),
    `solution` (the worked solution, ending with the answer line), `answer`."""

    def __init__(self, numbers, digits):
        self.numbers, self.digits = numbers, digits
        k = len(numbers)
        cols = [[(n // 10 ** j) % 10 for n in numbers] for j in range(digits)]
        lines = [f"add {k} numbers of {digits} digits, column by column from the ones:\n"]
        lines += [f"c{j:02d}: " + " ".join(str(d) for d in col) + "\n" for j, col in enumerate(cols)]
        lines.append("work:\n")
        self.text = "".join(lines)
        self.token_ids = [BOS] + list(self.text.encode())
        carry, work, written = 0, [], []
        for j, col in enumerate(cols):
            line, w, carry = column_line(j, col, carry)
            work.append(line)
            written.append(w)
        self.answer = sum(numbers)
        assert int(("" if carry == 0 else str(carry)) + "".join(str(w) for w in reversed(written))) == self.answer
        self.column_lines = work
        self.solution = "".join(work) + f"answer: {self.answer}\n"

    def key(self):
        return tuple(self.numbers)


def make_problem(rng, operands, digits):
    if not 2 <= operands <= MAX_OPERANDS or not 1 <= digits <= 99:
        raise ValueError(f"operands must be 2..{MAX_OPERANDS} and digits 1..99 (got {operands}, {digits})")
    lo = 10 ** (digits - 1)
    return ArithProblem([rng.randrange(lo, 10 * lo) for _ in range(operands)], digits)


def problems(seed, split, count, operands, digits, start=0):
    """Problems `start`..`start + count - 1` of a split: each drawn from its
    own stream (seed, split, index), so any one can be made alone."""
    return [make_problem(random.Random(f"arith:{seed}:{split}:{i}"), operands, digits)
            for i in range(start, start + count)]


def completion_text(token_ids):
    """The text a response spells: its bytes up to EOS."""
    out = bytearray()
    for t in token_ids:
        if t == EOS:
            break
        if t < 256:
            out.append(t)
    return out.decode("utf-8", errors="replace")


def check(problem, completion):
    """{score, answer_found, lines_right}: score 1 when the first `answer:`
    line holds exactly the sum; lines_right the share of the problem's
    column lines that appear exactly, in place, in the completion."""
    lines = completion.split("\n")
    answer_found, score = False, 0.0
    for line in lines:
        if line.startswith("answer:"):
            answer_found = True
            score = 1.0 if line[len("answer:"):].strip() == str(problem.answer) else 0.0
            break
    want = [w.rstrip("\n") for w in problem.column_lines]
    right = sum(1 for i, w in enumerate(want) if i < len(lines) and lines[i] == w)
    return {"score": score, "answer_found": answer_found, "lines_right": right / len(want)}


class ArithTask:
    """Draws RL prompts from one seeded stream (`rng`, whose state a resumed
    run restores), disjoint from the warm-up's streams."""

    def __init__(self, seed=0, operands=8, digits=20):
        self.rng = random.Random(f"arith-rl:{seed}")
        self.operands, self.digits = operands, digits

    def sample(self, count):
        return [make_problem(self.rng, self.operands, self.digits) for _ in range(count)]


class ArithScorer:
    """The reward of (problem, completion text) pairs: a pure function, no
    sandbox needed."""

    def score(self, pairs):
        return [check(p, c)["score"] for p, c in pairs]


def self_check():
    """Exits non-zero on the first failed property."""
    fails = []

    def want(cond, what):
        if not cond:
            fails.append(what)

    for k, d in [(2, 1), (3, 4), (8, 20), (11, 30)]:
        for p in problems(0, "check", 20, k, d):
            want(check(p, p.solution)["score"] == 1.0, f"{k}x{d}: the worked solution scores 0")
            want(check(p, p.solution)["lines_right"] == 1.0, f"{k}x{d}: the worked solution's lines")
            bad = p.solution.replace(f"answer: {p.answer}", f"answer: {p.answer + 1}")
            want(check(p, bad)["score"] == 0.0, f"{k}x{d}: a wrong answer scores 1")
            want(check(p, p.solution[:-3])["score"] == 0.0, f"{k}x{d}: a cut answer scores 1")
            want(check(p, "".join(p.column_lines))["answer_found"] is False, f"{k}x{d}: answer found in none")
            # the prompt alone determines the answer: read the columns back
            cols = [[int(x) for x in ln.split(": ")[1].split()] for ln in p.text.splitlines()[1:-1]]
            nums = [sum(col[i] * 10 ** j for j, col in enumerate(cols)) for i in range(k)]
            want(sum(nums) == p.answer and nums == p.numbers, f"{k}x{d}: the prompt does not spell the numbers")
            want(all(len(str(n)) == d for n in p.numbers), f"{k}x{d}: an operand has a leading zero")
    a = [p.text + p.solution for p in problems(3, "x", 5, 8, 20)]
    b = [p.text + p.solution for p in problems(3, "x", 5, 8, 20)]
    c = [p.text + p.solution for p in problems(4, "x", 5, 8, 20)]
    want(a == b and a != c, "the problems do not follow from the seed alone")
    t1, t2 = ArithTask(7, 3, 4), ArithTask(7, 3, 4)
    want([p.answer for p in t1.sample(10)] == [p.answer for p in t2.sample(10)], "ArithTask is not seeded")
    want(ArithScorer().score([(p, p.solution + "trailing text") for p in t1.sample(3)]) == [1.0] * 3,
         "text after the answer line changes the score")
    want(completion_text(list(b"ab\nc") + [EOS] + list(b"zz")) == "ab\nc", "completion_text")
    sol = sum(len(p.solution) for p in problems(0, "len", 20, 8, 20)) / 20
    want(sol >= 1024, f"the default solution is {sol:.0f} bytes, under 1K")
    for f in fails:
        print(f"BAD {f}")
    return 0 if not fails else 1


def length_table():
    print("| operands | digits | prompt bytes | solution bytes |")
    print("|---|---|---|---|")
    for k, d in [(3, 4), (4, 6), (6, 12), (8, 16), (8, 20), (10, 24)]:
        ps = problems(0, "len", 20, k, d)
        print(f"| {k} | {d} | {sum(len(p.text) for p in ps) / 20:.0f} | {sum(len(p.solution) for p in ps) / 20:.0f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-check", action="store_true", help="check the generator and the verifier, print lengths")
    ap.add_argument("--operands", type=int, default=8)
    ap.add_argument("--digits", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="print this many problems with their solutions")
    a = ap.parse_args(argv)
    if a.self_check:
        rc = self_check()
        length_table()
        print("arith_task: self-check " + ("passed" if rc == 0 else "FAILED"))
        return rc
    for p in problems(a.seed, "show", a.show, a.operands, a.digits):
        sys.stdout.write(p.text + p.solution + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
