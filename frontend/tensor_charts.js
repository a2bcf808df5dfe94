// The charts of the selected tensor (SPEC section 2): min / max / max |x|
// (linear, or max |x| on a log scale: the log toggle also puts the L2 and
// global norms on one, as growth towards overflow spans decades), mean ± std,
// NaN/Inf counts, L2 norm, and the run's global gradient norm, all over the
// same step range with the first anomaly and the selected step marked.
//
// What is not known is never drawn as a number: a record with no finite
// value has no min or max (a gap, and "no finite values" in the readout); the
// mean and L2 norm of a tensor holding NaN are NaN, and with +-Inf infinite
// (markers at the chart's edge, not the finite values' norm); op-level
// records do not hold the sums these come from ("not recorded for ops").
//
// Compared with a reference run, each chart draws one statistic per run, each
// line in the run's TensorBoard colour and labelled with the run's name.

import { Chart } from "./chart.js";
import { el } from "./dom.js";

// Op-level records (tb_numerics.oplevel) are written under "ops/...".
const OP_PREFIX = "ops/";
const NOT_RECORDED = "Not recorded for ops: op-level records keep the NaN/Inf counts, min and max (mean, std and L2 would cost every op output more passes).";

/**
 * Per record: how many values are finite, and the mean, std and L2 norm of
 * the whole tensor (non-finite where it holds a non-finite value); null
 * where the record does not hold the sums (op level).
 */
export function wholeTensor(f) {
  const n = f.count.length;
  const out = { finite: [], mean: [], std: [], l2: [] };
  for (let i = 0; i < n; i++) {
    const nan = f.nan[i];
    const pos = f.posinf[i];
    const neg = f.neginf[i];
    out.finite.push(f.count[i] - nan - pos - neg);
    if (f.mean[i] === null) {
      out.mean.push(null);
      out.std.push(null);
      out.l2.push(null);
    } else if (nan || pos || neg) {
      out.mean.push(nan || (pos && neg) ? NaN : pos ? Infinity : -Infinity);
      out.std.push(NaN);
      out.l2.push(nan ? NaN : Infinity);
    } else {
      out.mean.push(f.mean[i]);
      out.std.push(f.std[i]);
      out.l2.push(f.l2[i]);
    }
  }
  return out;
}

/**
 * min, max or max |x| with a gap (null: no marker) where a record has no
 * finite value: they are undefined there, not NaN; the counts chart and
 * the tinted column say what the values were.
 */
function finiteOnly(ys, whole) {
  return ys.map((v, i) => (whole.finite[i] === 0 ? null : v));
}

/** Whether the series is an op's: its records hold no sums (a record with no finite value says nothing). */
function opLevel(series, whole) {
  return (typeof series.tensor === "string" && series.tensor.startsWith(OP_PREFIX)) || whole.mean.every((m) => m === null);
}

export class TensorCharts {
  constructor({ onZoom, onLogChange }) {
    this.logButton = el("button", { type: "button", class: "log-toggle", "aria-pressed": "false", title: "Draw max |x|, the L2 norm and the global gradient norm on a log scale" }, "log |x|");
    this.logButton.addEventListener("click", () => onLogChange(this.logButton.getAttribute("aria-pressed") !== "true"));
    this.range = new Chart("Range: min, max, max |x|", { onZoom, extra: this.logButton });
    this.moments = new Chart("Mean ± std", { onZoom });
    this.counts = new Chart("NaN / Inf counts", { onZoom });
    this.norm = new Chart("L2 norm", { onZoom });
    this.global = new Chart("Global gradient norm", { onZoom });
    // The counts beside the range: what went non-finite is on the first screen.
    this.all = [this.range, this.counts, this.moments, this.norm, this.global];
    this.element = el("div", { class: "charts" }, this.all.map((c) => c.element));
  }

  /** Shows whether the log scale is on, before the charts have data to draw. */
  setLog(log) {
    this.logButton.setAttribute("aria-pressed", String(log));
  }

  /**
   * series: /series of the selected tensor (decoded); globalSeries: /series
   * of the global_norm row or null; domain: [first, last] step; anomalyStep
   * and selectedStep: markers (or null); runs: null, or, to compare,
   * [{run, colour}, {run, colour, series, globalSeries}] (the run shown, then
   * its reference).
   */
  set({ series, globalSeries, domain, anomalyStep, selectedStep, log, runs = null }) {
    this.setLog(log);
    const markers = [
      { step: anomalyStep, colour: "nonfinite", label: anomalyStep === null ? "" : "first anomaly" },
      { step: selectedStep, colour: "accent", dash: [4, 3], label: selectedStep === null ? "" : "selected step" },
    ].filter((m) => m.step !== null);
    const base = { steps: series.steps, stepEnd: series.step_end, domain, health: series.health, markers };
    if (runs) this.setCompared(series, globalSeries, base, log, runs);
    else this.setOne(series, base, log);
    this.setCounts(series, base);
    this.setGlobal(globalSeries, base, log, runs);
  }

  setOne(series, base, log) {
    const f = series.fields;
    const w = wholeTensor(f);
    const noFinite = (i) => (w.finite[i] === 0 ? "no finite values" : null);
    const range = (ys) => finiteOnly(ys, w);
    this.range.set({
      ...base,
      log,
      lines: log
        ? [{ label: "max |x|", colour: "series-3", ys: range(f.max_abs), words: noFinite }]
        : [
            { label: "min", colour: "series-1", ys: range(f.min), words: noFinite },
            { label: "max", colour: "series-2", ys: range(f.max), words: noFinite },
            { label: "max |x|", colour: "series-3", ys: range(f.max_abs), dash: [5, 3], words: noFinite },
          ],
    });
    if (opLevel(series, w)) {
      this.moments.message(NOT_RECORDED);
      this.norm.message(NOT_RECORDED);
      return;
    }
    this.moments.set({
      ...base,
      lines: [{ label: "mean", colour: "series-1", ys: w.mean }],
      band: {
        label: "± std",
        lo: w.mean.map((m, i) => (Number.isFinite(m) && Number.isFinite(w.std[i]) ? m - w.std[i] : null)),
        hi: w.mean.map((m, i) => (Number.isFinite(m) && Number.isFinite(w.std[i]) ? m + w.std[i] : null)),
        std: w.std,
      },
    });
    this.norm.set({ ...base, log, lines: [{ label: "L2", colour: "series-1", ys: w.l2 }] });
  }

  /** One line per run: the run shown solid, its reference dashed, in their run colours. */
  setCompared(series, globalSeries, base, log, runs) {
    const [own, ref] = runs;
    const line = (field, label, s, who, dash) => {
      const w = wholeTensor(s.fields);
      const ys = field === "mean" || field === "l2" ? w[field] : finiteOnly(s.fields[field], w);
      return { label: `${label} · ${who.run}`, hex: who.colour, dash, steps: s.steps, ys, words: (i) => (w.finite[i] === 0 ? "no finite values" : null) };
    };
    const pair = (field, label) => [line(field, label, series, own, []), ...(ref.series ? [line(field, label, ref.series, ref, [6, 3])] : [])];
    this.range.set({ ...base, log, lines: pair("max_abs", "max |x|") });
    if (opLevel(series, wholeTensor(series.fields))) {
      this.moments.message(NOT_RECORDED);
      this.norm.message(NOT_RECORDED);
    } else {
      this.moments.set({ ...base, lines: pair("mean", "mean") });
      this.norm.set({ ...base, log, lines: pair("l2", "L2") });
    }
  }

  setCounts(series, base) {
    const f = series.fields;
    this.counts.set({
      ...base,
      health: null,
      total: f.count,
      bars: [
        { label: "NaN", colour: "nonfinite", ys: f.nan },
        { label: "+Inf", colour: "warning", ys: f.posinf },
        { label: "-Inf", colour: "series-4", ys: f.neginf },
      ],
    });
  }

  setGlobal(globalSeries, base, log, runs) {
    if (!globalSeries) {
      this.global.message("No global gradient norm in this run: tb_numerics.log_gradients(grads, variables) records it.");
      return;
    }
    // A global_norm record is a scalar: its max is the norm (NaN where it is not finite).
    const norm = (s) => s.fields.max.map((v, i) => (s.fields.nan[i] ? NaN : s.fields.posinf[i] ? Infinity : v));
    const lines = runs
      ? [globalSeries, runs[1].globalSeries]
          .map((s, k) => s && { label: `global norm · ${runs[k].run}`, hex: runs[k].colour, dash: k ? [6, 3] : [], steps: s.steps, ys: norm(s) })
          .filter(Boolean)
      : [{ label: "global norm", colour: "series-2", ys: norm(globalSeries) }];
    this.global.set({ ...base, steps: globalSeries.steps, stepEnd: globalSeries.step_end, health: globalSeries.health, log, lines });
  }

  message(text) {
    for (const c of this.all) c.message(text);
  }

  redraw() {
    for (const c of this.all) c.draw();
  }
}
