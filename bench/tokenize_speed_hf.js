#!/usr/bin/env node
// tokenize_speed_hf.js: Hugging Face tokenizers (the Rust library, through
// its npm binding) measured as bench/tokenize_speed.c measures this
// project's tokenizer, for machines without Python's tokenizers:
//
//   RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
//     NODE_PATH=DIR/node_modules node bench/tokenize_speed_hf.js TOKENIZER TEXTFILE [--passes N] [--special]
//
// Each encode is awaited before the next starts (one at a time, one
// thread); the binding's per-call cost (a task on libuv's pool and a
// promise) weighs on the line-by-line figure, so bench/tokenize_speed_hf.py
// is the reference where Python is available. Rates are per second of the
// process's CPU time (all its threads), the wall-clock rate in brackets.
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');

const cpu = () => { const u = process.cpuUsage(); return (u.user + u.system) / 1e6; };

async function pass(tok, text, lines, special) {
  const t0 = process.hrtime.bigint(), c0 = cpu();
  let tokens = 0;
  const parts = lines ? text.split(/(?<=\n)/) : [text];
  for (const p of parts) tokens += (await tok.encode(p, null, { addSpecialTokens: special })).getLength();
  return [cpu() - c0, tokens, Number(process.hrtime.bigint() - t0) / 1e9];
}

async function report(tok, text, bytes, lines, special, passes) {
  const [cold, perPass] = await pass(tok, text, lines, special);
  const s = [], w = [];
  for (let i = 0; i < passes; i++) {
    const r = await pass(tok, text, lines, special);
    s.push(r[0]);
    w.push(r[2]);
  }
  s.sort((a, b) => a - b);
  w.sort((a, b) => a - b);
  const med = s[Math.floor(passes / 2)], wmed = w[Math.floor(passes / 2)];
  console.log(`encode ${(lines ? 'line by line' : 'whole file').padEnd(12)} ${(bytes / med / 1e6).toFixed(2).padStart(8)} MB/s ` +
    `${(perPass / med).toFixed(0).padStart(10)} tokens/s   (wall ${(bytes / wmed / 1e6).toFixed(2)} MB/s; ` +
    `cold first pass ${(bytes / cold / 1e6).toFixed(2)} MB/s; ` +
    `${perPass} tokens, ${passes} passes)`);
}

async function main() {
  const args = process.argv.slice(2);
  if (args.length < 2) { console.error('usage: tokenize_speed_hf.js TOKENIZER TEXTFILE [--passes N] [--special]'); process.exit(2); }
  let file = args[0];
  if (fs.statSync(file).isDirectory()) file = path.join(file, 'tokenizer.json');
  const passes = args.includes('--passes') ? Number(args[args.indexOf('--passes') + 1]) : 5;
  const special = args.includes('--special');
  const buf = fs.readFileSync(args[1]);
  const text = buf.toString('utf8');
  const times = [], walls = [];
  let tok;
  for (let i = 0; i < 3; i++) {
    const t0 = process.hrtime.bigint(), c0 = cpu();
    tok = Tokenizer.fromFile(file);
    times.push(cpu() - c0);
    walls.push(Number(process.hrtime.bigint() - t0) / 1e9);
  }
  console.log(`tokenizer ${args[0]} (Hugging Face tokenizers ${require('tokenizers/package.json').version}, npm binding): ` +
    `vocabulary ${tok.getVocabSize(true)}; text ${args[1]}: ${buf.length} bytes`);
  console.log(`load ${times[0].toFixed(3)} s (first), ${Math.min(...times).toFixed(3)} s (best of 3) of CPU time ` +
    `(wall, best: ${Math.min(...walls).toFixed(3)} s)`);
  await report(tok, text, buf.length, false, special, passes);
  await report(tok, text, buf.length, true, special, passes);
}

main().catch((e) => { console.error(e); process.exit(1); });
