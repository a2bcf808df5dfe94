// The rules the server's rules core publishes (/rules, tb_numerics/rules):
// the health codes with their names and words, the warning kinds with
// theirs, and the number format. The frontend keeps no copy of any of them:
// the dashboard loads them once (load()) before it draws anything.

import * as api from "./api.js";

let published = null;
let markReady;
/** Resolves with the rules once they are loaded. */
export const ready = new Promise((resolve) => (markReady = resolve));

/** Reads /rules (once); an ApiError where the server does not answer. */
export async function load() {
  if (published === null) {
    published = await api.rules();
    markReady(published);
  }
  return published;
}

function loaded() {
  if (published === null) throw new Error("the rules are not loaded yet (/rules)");
  return published;
}

/** The health codes in the legend's order: [{code, name, words}]. */
export function healths() {
  return loaded().health;
}

/** The code of the health called `name` ("nonfinite"), or undefined. */
export function code(name) {
  return loaded().health.find((h) => h.name === name)?.code;
}

/** The health of a code: {code, name, words}; for an unknown code, the code as its words. */
export function health(c) {
  return loaded().health.find((h) => h.code === c) ?? { code: c, name: "", words: String(c) };
}

/** The names of the warning kinds, in the order the server checks them. */
export function kindNames() {
  return loaded().kinds.map((k) => k.name);
}

/** A warning kind in words; a name the server does not publish, as itself with spaces. */
export function kindWords(name) {
  const k = loaded().kinds.find((x) => x.name === name);
  return k ? k.words : name.replace(/_/g, " ");
}

/** The number format: {digits, fixed_from, fixed_below, exp_digits, nan, posinf, neginf}. */
export function numberFormat() {
  return loaded().number;
}

/** The first components of tags that name a layer or variable after them ("gradients", ...). */
export function scopedTagHeads() {
  return loaded().scoped_tag_heads ?? [];
}
