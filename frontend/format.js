// Numbers and counts in words, the way the banner and tooltips print them:
// the format and the words are the server's (rules.js), so a number reads
// the same in a tooltip as in a banner or in `tb-numerics report`.

import * as rules from "./rules.js";

const INT = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

/** 4096 -> "4,096" (a fractional count is cut, as the server does). */
export function count(n) {
  return INT.format(Math.trunc(n));
}

/** A decimal string without trailing zeros after its point: "1.200" -> "1.2". */
function plain(s) {
  return s.includes(".") ? s.replace(/0+$/, "").replace(/\.$/, "") : s;
}

/**
 * A statistic as the server writes it (tb_numerics/rules/numbers.py):
 * `digits` significant digits where the rounded value is in
 * [fixed_from, fixed_below), else `exp_digits` with an exponent ("4.22e15");
 * toPrecision and toExponential round half away from zero, as the server does.
 */
export function number(x) {
  if (x === null || x === undefined) return "–";
  const f = rules.numberFormat();
  if (Number.isNaN(x)) return f.nan;
  if (x === Infinity) return f.posinf;
  if (x === -Infinity) return f.neginf;
  if (x === 0) return "0";
  const sign = x < 0 ? "-" : "";
  const a = Math.abs(x);
  const fixed = a.toPrecision(f.digits);
  const rounded = Number(fixed);
  if (rounded >= f.fixed_from && rounded < f.fixed_below) return sign + plain(fixed);
  const [mantissa, exponent] = a.toExponential(f.exp_digits - 1).split("e");
  return `${sign}${plain(mantissa)}e${Number(exponent)}`;
}

/** {nan, posinf, neginf, size} -> "2 NaN, 1 +Inf of 4,096 values". */
export function nonfiniteCounts({ nan, posinf, neginf, size }) {
  const f = rules.numberFormat();
  const parts = [];
  if (nan) parts.push(`${count(nan)} ${f.nan}`);
  if (posinf) parts.push(`${count(posinf)} ${f.posinf}`);
  if (neginf) parts.push(`${count(neginf)} ${f.neginf}`);
  return `${parts.join(", ") || "no non-finite values"} of ${count(size)} value${size === 1 ? "" : "s"}`;
}

/** A warning kind in words, as the server names it (rules.js). */
export function kind(k) {
  return typeof k === "string" ? rules.kindWords(k) : "";
}

/** A step range "1,200–1,299", or one step "1,200". */
export function steps(start, end) {
  return start === end ? count(start) : `${count(start)}–${count(end)}`;
}
