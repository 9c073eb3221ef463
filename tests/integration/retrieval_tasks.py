"""Checks of models/retrieval/retrieval_tasks.py (run by retrieval_tasks.sh):
the same arguments write the same file and the splits differ; every answer
is what the prompt's records say; prompt lengths sit just under the target;
the training batches are the generator's train prompts with the loss on the
answer and its newline only."""
import json
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "models", "retrieval"))
import retrieval_tasks as rt  # noqa: E402

SCRIPT = os.path.join(ROOT, "models", "retrieval", "retrieval_tasks.py")
RECORD = re.compile(r"^key ([A-Z0-9]{8}) = value ([a-z0-9]{6})$")
VAR = re.compile(r"^VAR ([A-Z]{5}) = ([A-Z]{5}|[0-9]{5})$")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, "--out", "-"] + list(args), check=True,
                          capture_output=True).stdout


def solve(prompt):
    """The answer a reader of the prompt gives, from its lines alone."""
    lines = prompt.split("\n")
    assert lines[0] + "\n" == rt.HEADER
    records, env, seen_keys = {}, {}, []
    for line in lines[1:-2]:
        m, v = RECORD.match(line), VAR.match(line)
        assert m or v, "unexpected line %r" % line
        if m:
            seen_keys.append(m.group(1))
            records[m.group(1)] = m.group(2)
        else:
            name, src = v.groups()
            assert name not in env, "variable %s assigned twice" % name
            # A chain's variable is assigned after the one it copies.
            env[name] = src if src.isdigit() else env[src]
    assert len(seen_keys) == len(set(seen_keys)), "a key appears twice"
    question, answer_line = lines[-2], lines[-1]
    assert answer_line == "Answer: "
    m = re.match(r"^Question: what is the value of key ([A-Z0-9]{8})\?$", question)
    if m:
        return records[m.group(1)]
    m = re.match(r"^Question: what are the values of keys (.*), in this order\?$", question)
    if m:
        return ", ".join(records[k] for k in m.group(1).split(", "))
    m = re.match(r"^Question: what is the value of VAR ([A-Z]{5})\?$", question)
    assert m, "unexpected question %r" % question
    return env[m.group(1)]


class Generator(unittest.TestCase):
    def test_deterministic(self):
        a = run("--seed", "5", "--n", "3", "--contexts", "600,1200")
        self.assertEqual(a, run("--seed", "5", "--n", "3", "--contexts", "600,1200"))
        self.assertNotEqual(a, run("--seed", "6", "--n", "3", "--contexts", "600,1200"))
        self.assertNotEqual(a, run("--seed", "5", "--n", "3", "--contexts", "600,1200", "--split", "train"))
        rows = [json.loads(line) for line in a.decode().splitlines()]
        self.assertEqual(len(rows), 2 * 3 * 3)
        self.assertEqual(len({r["prompt"] for r in rows}), len(rows))
        for r in rows:
            self.assertTrue({"prompt", "answer", "variant", "context"} <= set(r))

    def test_answers_and_lengths(self):
        record_len = len(rt.record("K" * 8, "v" * 6))
        for t in rt.tasks(11, "heldout", rt.VARIANTS, [1000, 4096], 20):
            self.assertEqual(solve(t["prompt"]), t["answer"], t["prompt"])
            self.assertNotIn("\n", t["answer"])
            n = len(t["prompt"].encode())
            self.assertLessEqual(n, t["context"])
            self.assertGreater(n, t["context"] - record_len)
            self.assertTrue(0 <= t["depth"] <= 1)
        multi = rt.make_task(11, "heldout", "multikey", 4096, 0, keys=3)
        self.assertEqual(len(multi["answer"].split(", ")), 3)

    def test_depths_spread(self):
        depths = [rt.make_task(2, "heldout", "single", 2048, i)["depth"] for i in range(200)]
        self.assertLess(min(depths), 0.1)
        self.assertGreater(max(depths), 0.9)

    def test_refusals(self):
        with self.assertRaises(ValueError):
            rt.make_task(1, "heldout", "vartrack", 200, 0)
        with self.assertRaises(ValueError):
            rt.make_task(1, "heldout", "nosuch", 2048, 0)
        bad = subprocess.run([sys.executable, SCRIPT, "--out", "-", "--variants", "single,nosuch"],
                             capture_output=True)
        self.assertEqual(bad.returncode, 2)
        self.assertIn(b"unknown variant nosuch", bad.stderr)

    def test_batches_are_the_train_prompts(self):
        variants = ["single", "vartrack"]
        batches = rt.train_batches(4, variants, 800, 3, start=2, offset=5)
        for step in (2, 3):
            batch = next(batches)
            width = len(batch[0][0])
            for j, (ids, mask) in enumerate(batch):
                index = 5 + step * 3 + j   # the prompts numbered on from those earlier stages drew
                t = rt.make_task(4, "train", variants[index % 2], 800, index)
                p, a = t["prompt"].encode(), (t["answer"] + "\n").encode()
                self.assertEqual(len(ids), width)
                self.assertEqual(ids[0], rt.BOS)
                self.assertEqual(bytes(ids[1:1 + len(p)]), p)
                self.assertEqual(bytes(ids[1 + len(p):1 + len(p) + len(a)]), a)
                self.assertTrue(all(x == rt.PAD for x in ids[1 + len(p) + len(a):]))
                self.assertEqual(mask, [0] * (1 + len(p)) + [1] * len(a) + [0] * (width - 1 - len(p) - len(a)))
        held = rt.make_task(4, "heldout", "single", 800, 6)["prompt"]
        self.assertNotEqual(held, rt.make_task(4, "train", "single", 800, 6)["prompt"])

    def test_drills(self):
        """Answered questions before the final one: each answers a record of
        the prompt, each answer (and its newline) is supervised, the prompt
        stays within the context and still ends in the final question; none
        asked, the prompt carries no drill list."""
        self.assertNotIn("drills", rt.make_task(2, "train", "single", 1024, 0))
        for variant in ("single", "multikey"):
            for index in range(6):
                t = rt.make_task(2, "train", variant, 1024, index, drills=4)
                p = t["prompt"]
                self.assertLessEqual(len(p.encode()), 1024)   # the context bounds the prompt, as without drills
                self.assertTrue(p.endswith("Answer: ") and p.rindex("Question:") >= max(e for _, e in t["drills"]))
                records = dict(re.findall(r"key (\w{8}) = value (\w{6})\n", p))
                self.assertEqual(len(t["drills"]), 4)
                asked = set()
                for start, end in t["drills"]:
                    key = re.search(r"key (\w{8})\?\nAnswer: $", p[:start]).group(1)
                    self.assertEqual(p[start:end], records[key] + "\n")
                    asked.add(key)
                self.assertEqual(len(asked), 4)   # distinct records while there are enough
                ids, mask = rt.encode(t)
                self.assertEqual(sum(mask), 4 * 7 + len(t["answer"]) + 1)
                for start, end in t["drills"]:
                    self.assertEqual(mask[1 + start:1 + end], [1] * (end - start))
                    self.assertEqual(mask[start], 0)
        batch = next(rt.train_batches(2, ["single", "vartrack"], 1024, 2, drills=3))
        self.assertEqual(sum(batch[0][1]), 3 * 7 + 7)
        self.assertEqual(sum(batch[1][1]), 6)   # vartrack: the five digits and the newline, no drills


if __name__ == "__main__":
    unittest.main()
