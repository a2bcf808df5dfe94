// The timeline's rows in one order: the layer-level rows (inputs, layers,
// loss, gradients, update) in execution order as /timeline gives them, each
// followed by the op-level rows ("ops/...", from op_numerics or a replayed
// step) of the ops it ran, in their own execution order. /timeline sorts the
// two kinds by two counters (a layer's index, an op's position in the
// replayed step), which interleaves them; here each op is placed under the
// layer whose name its scope holds ("mlp/dense_3/MatMul" under
// "dense_3/output"; a gradient op under the layer's gradients), and ops
// whose scope names no layer (a loss's ops, an optimizer's) under the next
// layer row of their phase after the op before them.

import * as rules from "./rules.js";

const OP_PREFIX = "ops/";
const GRADIENT_SCOPE = "gradient_tape/";

/** The scope a layer-level row's tag names: "dense_3/output" -> "dense_3", "gradients/mlp/d/kernel" -> "mlp/d". */
function layerScope(row) {
  const parts = row.tensor.split("/");
  if (parts.length < 2) return null;
  const body = rules.scopedTagHeads().includes(parts[0]) ? parts.slice(1) : parts;
  return body.length > 1 ? body.slice(0, -1).join("/") : body.join("/");
}

/** "ops/gradient_tape/mlp/dense_3/MatMul/MatMul" -> "/mlp/dense_3/MatMul/" (the op's scope, without its own name). */
function opScope(row) {
  let name = row.tensor.slice(OP_PREFIX.length);
  if (name.startsWith(GRADIENT_SCOPE)) name = name.slice(GRADIENT_SCOPE.length);
  const parts = name.split("/");
  return `/${parts.slice(0, -1).join("/")}/`;
}

/** The index in `layers` of the layer row an op belongs to, or -1. */
function ownerOf(op, layers) {
  const scope = opScope(op);
  let best = -1;
  let bestLength = 0;
  layers.forEach((layer, i) => {
    const own = layer.scope;
    if (own && layer.row.phase === op.phase && scope.includes(`/${own}/`) && own.length > bestLength) {
      best = i;
      bestLength = own.length;
    }
  });
  return best;
}

/** Where an op of no layer goes: with the op before it if that one had no layer either, else the next layer row. */
function fallbackOwner(op, layers, prev) {
  const samePhase = prev.at >= 0 && layers[prev.at].row.phase === op.phase;
  if (samePhase && !prev.matched) return prev.at;
  const next = layers.findIndex((l, i) => i > (samePhase ? prev.at : -1) && l.row.phase === op.phase);
  return next >= 0 ? next : samePhase ? prev.at : -1;
}

/**
 * The rows in display order, each op row marked `nested: true` under its
 * layer row. Rows without any layer row (op_numerics alone) keep their order.
 */
export function orderRows(rows) {
  const layers = rows.filter((r) => !r.tensor.startsWith(OP_PREFIX)).map((row) => ({ row, scope: layerScope(row), ops: [] }));
  const ops = rows.filter((r) => r.tensor.startsWith(OP_PREFIX));
  if (!layers.length || !ops.length) return rows;
  const unplaced = [];
  const prev = { at: -1, matched: false };
  for (const op of ops) {
    const owner = ownerOf(op, layers);
    const at = owner >= 0 ? owner : fallbackOwner(op, layers, prev);
    if (at < 0) {
      unplaced.push(op);
      continue;
    }
    layers[at].ops.push({ ...op, nested: true });
    Object.assign(prev, { at, matched: owner >= 0 });
  }
  return [...layers.flatMap((l) => [l.row, ...l.ops]), ...unplaced];
}
