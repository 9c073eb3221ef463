#!/usr/bin/env node
// Records Hugging Face tokenizers' ids and decodes for every corpus text and
// every tokenizer of variants.json, through the official Node binding of the
// same Rust library (npm package `tokenizers`): the provisional ground truth
// on machines without Python's tokenizers. tokenizer_golden.py writes the
// same files from Python (and adds transformers' ids and streamed decodes);
// the C tests read either.
//
//   npm install --prefix DIR tokenizers@0.23.2
//   NODE_PATH=DIR/node_modules node golden_node.js OUTDIR [SHARED_TOKENIZERS]
//
// SHARED_TOKENIZERS: the folder holding qwen3/ and deepseek_v3/ (default
// ../shared/tokenizers from the repository root). Variants whose base is
// missing are left out, with a message.
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');

const here = __dirname;
const root = path.resolve(here, '..', '..', '..');

function basePath(base, shared) {
  const [kind, name] = base.split(':');
  if (kind === 'shared') return path.join(shared, name, 'tokenizer.json');
  if (kind === 'data') return path.join(here, name, 'tokenizer.json');
  throw new Error(`unknown base ${base}`);
}

function applyPatches(obj, patches) {
  for (const [p, value] of patches) {
    let o = obj;
    for (const k of p.slice(0, -1)) o = o[k];
    o[p[p.length - 1]] = value;
  }
  return obj;
}

function corpus() {
  const dir = path.join(here, 'corpus');
  return fs.readdirSync(dir).filter((f) => f.endsWith('.txt')).sort()
    .map((f) => ({ name: f.slice(0, -4), text: fs.readFileSync(path.join(dir, f), 'utf8') }));
}

async function record(v, shared, items, version) {
  const file = basePath(v.base, shared);
  if (!fs.existsSync(file)) {
    console.log(`skip ${v.name}: ${file} not found`);
    return null;
  }
  const json = applyPatches(JSON.parse(fs.readFileSync(file, 'utf8')), v.patches);
  const tok = Tokenizer.fromString(JSON.stringify(json));
  const out = {
    name: v.name, base: v.base, patches: v.patches,
    source: `Hugging Face tokenizers ${version} (Rust) through its npm binding`,
    vocab_size: tok.getVocabSize(true), items: {},
  };
  for (const { name, text } of items) {
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    const idsSpecial = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    out.items[name] = {
      ids, ids_special: idsSpecial,
      decoded: await tok.decode(ids, false),
      decoded_special: await tok.decode(idsSpecial, false),
      decoded_skip: await tok.decode(idsSpecial, true),
    };
  }
  return out;
}

async function main() {
  if (process.argv.length < 3) {
    console.error('usage: node golden_node.js OUTDIR [SHARED_TOKENIZERS]');
    process.exit(2);
  }
  const outDir = process.argv[2];
  const shared = process.argv[3] || path.join(root, '..', 'shared', 'tokenizers');
  const version = require('tokenizers/package.json').version;
  const { variants } = JSON.parse(fs.readFileSync(path.join(here, 'variants.json'), 'utf8'));
  const items = corpus();
  fs.mkdirSync(outDir, { recursive: true });
  for (const v of variants) {
    const g = await record(v, shared, items, version);
    if (!g) continue;
    const dest = path.join(outDir, `${v.name}.json`);
    fs.writeFileSync(dest, JSON.stringify(g) + '\n');
    const n = Object.values(g.items).reduce((a, x) => a + x.ids.length, 0);
    console.log(`wrote ${dest}: ${items.length} texts, ${n} ids (${g.source})`);
  }
}

main().catch((e) => { console.error(e); process.exit(1); });
