// Numbers and counts in words, the way the banner and tooltips print them.

const INT = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

/** 4096 -> "4,096". */
export function count(n) {
  return INT.format(n);
}

/** A statistic with 4 significant digits; NaN/Inf spelled out. */
export function number(x) {
  if (x === null || x === undefined) return "–";
  if (Number.isNaN(x)) return "NaN";
  if (x === Infinity) return "+Inf";
  if (x === -Infinity) return "-Inf";
  if (x === 0) return "0";
  const a = Math.abs(x);
  if (a >= 1e5 || a < 1e-3) return x.toExponential(3).replace(/\.?0+e/, "e");
  return String(Number(x.toPrecision(4)));
}

/** {nan, posinf, neginf, size} -> "2 NaN, 1 +Inf of 4,096 values". */
export function nonfiniteCounts({ nan, posinf, neginf, size }) {
  const parts = [];
  if (nan) parts.push(`${count(nan)} NaN`);
  if (posinf) parts.push(`${count(posinf)} +Inf`);
  if (neginf) parts.push(`${count(neginf)} -Inf`);
  return `${parts.join(", ") || "no non-finite values"} of ${count(size)} value${size === 1 ? "" : "s"}`;
}

// Warning kinds whose name alone says too little; the others read as their
// name with spaces ("overflow_risk" -> "overflow risk").
const KIND_WORDS = {
  dead_units: "dead units",
  vanishing_by_depth: "vanishing gradients by depth",
  exploding_by_depth: "exploding gradients by depth",
  saturation: "saturated activations",
  update_ratio: "update ratio out of range",
  headroom: "headroom running out",
  square_overflow: "gradient's square overflows",
};

/** A warning kind in words: "saturation" -> "saturated activations". */
export function kind(k) {
  if (typeof k !== "string") return "";
  return Object.hasOwn(KIND_WORDS, k) ? KIND_WORDS[k] : k.replace(/_/g, " ");
}

/** A step range "1,200–1,299", or one step "1,200". */
export function steps(start, end) {
  return start === end ? count(start) : `${count(start)}–${count(end)}`;
}
