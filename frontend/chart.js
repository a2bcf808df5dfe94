// One step-indexed canvas chart: lines (with gaps), an optional band
// (mean ± std), stacked count bars, vertical markers (the anomaly step),
// linear or log y. Non-finite values never become lines: the line breaks and
// a marker sits at the edge (+Inf top, -Inf bottom, NaN a cross at the top).
// Dragging selects a step range (onZoom), double-click resets it. From the
// keyboard (the canvas takes focus): the arrows move a cursor over the steps
// and read them out, Shift with the arrows selects a range, Enter zooms to
// it, Escape drops the range or, with none, shows every step again.

import { el, replace } from "./dom.js";
import * as fmt from "./format.js";
import * as rules from "./rules.js";
import { color } from "./theme.js";

const M = { left: 58, right: 10, top: 10, bottom: 20 };

export function niceTicks(lo, hi, n) {
  const span = hi - lo || Math.abs(hi) || 1;
  const raw = span / n;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || 10 * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
  return ticks;
}

/** Index of the step nearest to `step` in a sorted array. */
function nearest(steps, step) {
  let lo = 0;
  let hi = steps.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (steps[mid] < step) lo = mid + 1;
    else hi = mid;
  }
  return lo > 0 && step - steps[lo - 1] < steps[lo] - step ? lo - 1 : lo;
}

export class Chart {
  constructor(title, { onZoom, extra } = {}) {
    this.onZoom = onZoom;
    this.data = null;
    this.cursor = null; // the keyboard's point index
    this.anchor = null; // where a Shift+arrow range began
    this.title = title;
    this.canvas = el("canvas", {
      tabindex: "0",
      role: "application",
      "aria-label": `${title}: left and right arrows read the steps, Shift+arrows select a range, Enter zooms to it, Escape shows every step`,
    });
    this.legend = el("div", { class: "chart-legend" });
    this.readout = el("div", { class: "readout", "aria-live": "polite" });
    this.note = el("div", { class: "note", hidden: true });
    this.element = el(
      "section",
      { class: "chart", "aria-label": title },
      el("div", { class: "chart-head" }, el("h3", {}, el("span", {}, title)), this.legend, extra),
      this.canvas,
      this.note,
      this.readout
    );
    this.canvas.addEventListener("mousedown", (e) => {
      this.dragFrom = this.localX(e);
      this.dragTo = this.dragFrom;
    });
    this.canvas.addEventListener("mousemove", (e) => this.move(e));
    window.addEventListener("mouseup", (e) => this.release(e));
    this.canvas.addEventListener("mouseleave", () => {
      this.hoverX = null;
      this.readout.textContent = "";
      this.draw();
    });
    this.canvas.addEventListener("dblclick", () => this.onZoom && this.onZoom(null, null));
    this.canvas.addEventListener("keydown", (e) => this.key(e));
    this.canvas.addEventListener("blur", () => {
      this.cursor = null;
      this.anchor = null;
      this.hoverX = null;
      this.draw();
    });
  }

  /** Shows a sentence instead of the plot (e.g. "no global norm logged"). */
  message(text) {
    this.data = null;
    this.note.textContent = text;
    this.note.hidden = false;
    this.canvas.hidden = true;
    replace(this.legend);
    this.readout.textContent = "";
  }

  /**
   * data: {steps, stepEnd, domain:[x0,x1], lines:[{label, colour, ys, dash, steps?}],
   *        bars:[{label, colour, ys}], band:{lo, hi}, health, markers:[{step, colour, label}], log}
   */
  set(data) {
    this.data = data;
    this.cursor = null;
    this.anchor = null;
    this.dragFrom = null;
    this.note.hidden = true;
    this.canvas.hidden = false;
    const keys = [...(data.lines || []), ...(data.bars || [])];
    replace(
      this.legend,
      keys.map((s) => el("span", {}, el("i", { style: `background: ${s.hex || `var(--${s.colour})`}` }), s.label)),
      data.band ? el("span", {}, el("i", { style: "background: var(--band); height: 8px" }), data.band.label) : null,
      (data.markers || []).map((m) => el("span", {}, el("i", { style: `background: var(--${m.colour}); width: 3px; height: 10px` }), m.label))
    );
    this.draw();
  }

  localX(e) {
    return e.clientX - this.canvas.getBoundingClientRect().left;
  }

  xScale() {
    const [x0, x1] = this.data.domain;
    const w = this.width - M.left - M.right;
    const span = x1 - x0 || 1;
    return {
      toPx: (s) => M.left + ((s - x0) / span) * w,
      toStep: (px) => x0 + ((px - M.left) / w) * span,
    };
  }

  yRange() {
    const { lines = [], bars = [], band, log } = this.data;
    let lo = Infinity;
    let hi = -Infinity;
    const take = (v) => {
      if (!Number.isFinite(v) || (log && v <= 0)) return;
      lo = Math.min(lo, v);
      hi = Math.max(hi, v);
    };
    for (const s of lines) s.ys.forEach(take);
    if (band) {
      band.lo.forEach(take);
      band.hi.forEach(take);
    }
    if (bars.length) {
      take(0);
      this.data.steps.forEach((_, i) => take(bars.reduce((t, b) => t + (Number.isFinite(b.ys[i]) ? b.ys[i] : 0), 0)));
    }
    if (lo === Infinity) return null;
    if (log) {
      const a = Math.floor(Math.log10(lo));
      const b = Math.max(a + 1, Math.ceil(Math.log10(hi)));
      return { lo: a, hi: b, toPx: (v) => this.plotBottom - ((Math.log10(v) - a) / (b - a)) * this.plotH };
    }
    if (bars.length) {
      // Counts: from 0, and 0..1 when all are 0, so "none" reads as a flat floor.
      return { lo: 0, hi: Math.max(1, hi * 1.06), toPx: (v) => this.plotBottom - (v / Math.max(1, hi * 1.06)) * this.plotH };
    }
    if (lo === hi) {
      const pad = Math.abs(lo) * 0.1 || 1;
      lo -= pad;
      hi += pad;
    } else {
      const pad = (hi - lo) * 0.06;
      lo -= pad;
      hi += pad;
    }
    return { lo, hi, toPx: (v) => this.plotBottom - ((v - lo) / (hi - lo)) * this.plotH };
  }

  draw() {
    if (!this.data || this.canvas.hidden) return;
    const dpr = window.devicePixelRatio || 1;
    this.width = this.canvas.clientWidth || 400;
    this.height = this.canvas.clientHeight || 170;
    this.canvas.width = Math.round(this.width * dpr);
    this.canvas.height = Math.round(this.height * dpr);
    this.plotBottom = this.height - M.bottom;
    this.plotH = this.plotBottom - M.top;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, this.width, this.height);
    ctx.font = "11px Roboto, Arial, sans-serif";
    const x = this.xScale();
    const y = this.yRange();
    const clip = () => {
      ctx.save();
      ctx.beginPath();
      ctx.rect(M.left, M.top - 1, this.width - M.left - M.right, this.plotH + 2);
      ctx.clip();
    };
    clip();
    this.drawHealth(ctx, x);
    ctx.restore();
    this.drawAxes(ctx, x, y);
    if (y) {
      clip();
      if (this.data.band) this.drawBand(ctx, x, y);
      if (this.data.bars) this.drawBars(ctx, x, y);
      for (const s of this.data.lines || []) this.drawLine(ctx, x, y, s);
      ctx.restore();
    } else {
      ctx.fillStyle = color("muted");
      ctx.fillText(this.data.log ? "No positive finite values to draw on a log scale" : "No finite values in this range", M.left + 8, M.top + 16);
    }
    this.drawMarkers(ctx, x);
    this.drawOverlay(ctx, x);
  }

  /** Columns where the tensor was non-finite, tinted behind everything. */
  drawHealth(ctx, x) {
    const { health, steps, stepEnd } = this.data;
    if (!health) return;
    ctx.fillStyle = color("nonfinite-band");
    const nonfinite = rules.code("nonfinite");
    health.forEach((h, i) => {
      if (h !== nonfinite) return;
      const a = x.toPx(steps[i]);
      const b = x.toPx(stepEnd ? stepEnd[i] + 1 : steps[i] + 1);
      ctx.fillRect(a, M.top, Math.max(3, b - a), this.plotH);
    });
  }

  drawAxes(ctx, x, y) {
    const right = this.width - M.right;
    ctx.strokeStyle = color("grid");
    ctx.fillStyle = color("muted");
    ctx.lineWidth = 1;
    ctx.textBaseline = "middle";
    if (y) {
      // Log: every k-th power of ten, k chosen for at most ~6 labels, aligned on 10^0.
      const k = Math.max(1, Math.ceil((y.hi - y.lo + 1) / 6));
      const ticks = this.data.log
        ? Array.from({ length: y.hi - y.lo + 1 }, (_, i) => y.lo + i).filter((p) => p % k === 0).map((p) => 10 ** p)
        : niceTicks(y.lo, y.hi, 4);
      ctx.textAlign = "right";
      for (const t of ticks) {
        const py = Math.round(y.toPx(t)) + 0.5;
        if (py < M.top - 1 || py > this.plotBottom + 1) continue;
        ctx.beginPath();
        ctx.moveTo(M.left, py);
        ctx.lineTo(right, py);
        ctx.stroke();
        ctx.fillText(fmt.number(t), M.left - 4, py);
      }
    }
    const [x0, x1] = this.data.domain;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const xt = niceTicks(x0, x1, Math.max(2, Math.floor((right - M.left) / 90))).filter((t) => Number.isInteger(t));
    for (const t of xt) {
      const px = x.toPx(t);
      if (px < M.left - 1 || px > right + 1) continue;
      ctx.fillRect(Math.round(px), this.plotBottom, 1, 4);
      ctx.fillText(fmt.count(t), px, this.plotBottom + 5);
    }
    ctx.strokeStyle = color("border");
    ctx.strokeRect(M.left + 0.5, M.top + 0.5, right - M.left, this.plotH);
    ctx.textAlign = "left";
  }

  drawLine(ctx, x, y, s) {
    // A line of another run brings its own steps.
    const steps = s.steps || this.data.steps;
    const stroke = s.hex || color(s.colour);
    ctx.strokeStyle = stroke;
    ctx.lineWidth = 1.5;
    ctx.setLineDash(s.dash || []);
    ctx.beginPath();
    let open = false;
    const nonfinite = [];
    steps.forEach((step, i) => {
      const v = s.ys[i];
      if (!Number.isFinite(v) || (this.data.log && v <= 0)) {
        if (!Number.isFinite(v) && v !== null) nonfinite.push([step, v]); // null: not recorded
        open = false; // a gap: never a line to infinity
        return;
      }
      const px = x.toPx(step);
      const py = y.toPx(v);
      if (open) ctx.lineTo(px, py);
      else ctx.moveTo(px, py);
      open = true;
    });
    ctx.stroke();
    ctx.setLineDash([]);
    // A lone finite point between gaps (or a series of one record) gets a dot so it is not lost.
    ctx.fillStyle = stroke;
    steps.forEach((step, i) => {
      const ok = (j) => j >= 0 && j < steps.length && Number.isFinite(s.ys[j]) && !(this.data.log && s.ys[j] <= 0);
      if (ok(i) && !ok(i - 1) && !ok(i + 1)) {
        ctx.beginPath();
        ctx.arc(x.toPx(step), y.toPx(s.ys[i]), 3, 0, 2 * Math.PI);
        ctx.fill();
      }
    });
    ctx.fillStyle = color("nonfinite");
    ctx.strokeStyle = color("nonfinite");
    for (const [step, v] of nonfinite) {
      const px = x.toPx(step);
      ctx.beginPath();
      if (v === Infinity) {
        ctx.moveTo(px - 4, M.top + 7);
        ctx.lineTo(px + 4, M.top + 7);
        ctx.lineTo(px, M.top + 1);
        ctx.fill();
      } else if (v === -Infinity) {
        ctx.moveTo(px - 4, this.plotBottom - 7);
        ctx.lineTo(px + 4, this.plotBottom - 7);
        ctx.lineTo(px, this.plotBottom - 1);
        ctx.fill();
      } else {
        ctx.lineWidth = 1.5;
        ctx.moveTo(px - 3, M.top + 2);
        ctx.lineTo(px + 3, M.top + 8);
        ctx.moveTo(px + 3, M.top + 2);
        ctx.lineTo(px - 3, M.top + 8);
        ctx.stroke();
      }
    }
  }

  drawBand(ctx, x, y) {
    const { steps, band } = this.data;
    ctx.fillStyle = color("band");
    let seg = [];
    const flush = () => {
      if (seg.length > 1) {
        ctx.beginPath();
        seg.forEach(([px, lo], k) => (k ? ctx.lineTo(px, lo) : ctx.moveTo(px, lo)));
        for (let k = seg.length - 1; k >= 0; k--) ctx.lineTo(seg[k][0], seg[k][2]);
        ctx.closePath();
        ctx.fill();
      }
      seg = [];
    };
    steps.forEach((step, i) => {
      if (Number.isFinite(band.lo[i]) && Number.isFinite(band.hi[i])) seg.push([x.toPx(step), y.toPx(band.lo[i]), y.toPx(band.hi[i])]);
      else flush();
    });
    flush();
  }

  drawBars(ctx, x, y) {
    const { steps, stepEnd, bars } = this.data;
    const base = y.toPx(0);
    steps.forEach((step, i) => {
      let top = base;
      const a = x.toPx(step);
      const w = Math.max(2, x.toPx(stepEnd ? stepEnd[i] + 1 : step + 1) - a);
      for (const b of bars) {
        const v = b.ys[i];
        if (!Number.isFinite(v) || v <= 0) continue;
        // A count of 1 among thousands still shows: at least 3 px.
        const h = Math.max(3, base - y.toPx(v));
        ctx.fillStyle = color(b.colour);
        ctx.fillRect(a, top - h, w, h);
        top -= h;
      }
    });
  }

  drawMarkers(ctx, x) {
    const [x0, x1] = this.data.domain;
    for (const m of this.data.markers || []) {
      if (m.step === null || m.step < x0 || m.step > x1) continue;
      const px = Math.round(x.toPx(m.step)) + 0.5;
      ctx.strokeStyle = color(m.colour);
      ctx.lineWidth = 2;
      ctx.setLineDash(m.dash || []);
      ctx.beginPath();
      ctx.moveTo(px, M.top);
      ctx.lineTo(px, this.plotBottom);
      ctx.stroke();
      ctx.setLineDash([]);
    }
  }

  /** The drag selection and the hover line. */
  drawOverlay(ctx) {
    if (this.dragFrom !== undefined && this.dragFrom !== null && Math.abs(this.dragTo - this.dragFrom) > 2) {
      ctx.fillStyle = color("band");
      const a = Math.min(this.dragFrom, this.dragTo);
      ctx.fillRect(a, M.top, Math.abs(this.dragTo - this.dragFrom), this.plotH);
    }
    if (this.hoverX !== null && this.hoverX !== undefined) {
      ctx.strokeStyle = color("muted");
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(this.hoverX + 0.5, M.top);
      ctx.lineTo(this.hoverX + 0.5, this.plotBottom);
      ctx.stroke();
    }
  }

  move(e) {
    if (!this.data) return;
    const px = this.localX(e);
    if (this.dragFrom !== undefined && this.dragFrom !== null) this.dragTo = px;
    const { steps } = this.data;
    if (!steps.length || px < M.left || px > this.width - M.right) {
      this.hoverX = null;
      this.readout.textContent = "";
      this.draw();
      return;
    }
    this.readAt(nearest(steps, this.xScale().toStep(px)));
  }

  /** The readout of point `i` (each line's value, or what is known instead), with the hover line on it. */
  readAt(i) {
    const { steps } = this.data;
    this.hoverX = Math.round(this.xScale().toPx(steps[i]));
    const end = this.data.stepEnd ? this.data.stepEnd[i] : steps[i];
    const parts = [...(this.data.lines || []), ...(this.data.bars || [])].map((s) => {
      const j = s.steps ? nearest(s.steps, steps[i]) : i;
      const off = s.steps && s.steps[j] !== steps[i] ? ` (step ${fmt.count(s.steps[j])})` : "";
      const known = s.words ? s.words(j) : null;
      return `${s.label} ${known ?? fmt.number(s.ys[j])}${off}`;
    });
    if (this.data.band) parts.push(`${this.data.band.label} ${fmt.number(this.data.band.std[i])}`);
    const total = this.data.total ? ` of ${fmt.count(this.data.total[i])} values` : "";
    this.readout.textContent = `${end !== steps[i] ? "Steps" : "Step"} ${fmt.steps(steps[i], end)}: ${parts.join(" · ")}${total}`;
    this.draw();
  }

  /** The keyboard: a cursor over the points, a range with Shift, Enter zooms, Escape. */
  key(e) {
    if (!this.data || !this.data.steps.length) return;
    const n = this.data.steps.length;
    const at = this.cursor ?? nearest(this.data.steps, this.data.markers?.[0]?.step ?? this.data.steps[0]);
    const moves = { ArrowLeft: at - 1, ArrowRight: at + 1, PageUp: at - 10, PageDown: at + 10, Home: 0, End: n - 1 };
    if (e.key in moves) {
      if (e.shiftKey && this.anchor === null) this.anchor = at;
      if (!e.shiftKey) this.anchor = null;
      this.cursor = Math.min(n - 1, Math.max(0, moves[e.key]));
      this.selectKeys();
      this.readAt(this.cursor);
    } else if (e.key === "Enter" && this.anchor !== null && this.anchor !== this.cursor && this.onZoom) {
      const [a, b] = [this.anchor, this.cursor].sort((p, q) => p - q);
      this.anchor = null;
      this.dragFrom = null;
      this.onZoom(this.data.steps[a], this.data.stepEnd ? this.data.stepEnd[b] : this.data.steps[b]);
    } else if (e.key === "Escape") {
      if (this.anchor !== null) {
        this.anchor = null;
        this.dragFrom = null;
        this.draw();
      } else if (this.onZoom) {
        this.onZoom(null, null);
      }
    } else {
      return;
    }
    e.preventDefault();
  }

  /** The keyboard's range, drawn as a drag would draw it. */
  selectKeys() {
    if (this.anchor === null) {
      this.dragFrom = null;
      return;
    }
    const x = this.xScale();
    this.dragFrom = x.toPx(this.data.steps[this.anchor]);
    this.dragTo = x.toPx(this.data.steps[this.cursor]);
  }

  release(e) {
    if (this.dragFrom === undefined || this.dragFrom === null || this.anchor !== null) return;
    const from = this.dragFrom;
    const to = this.localX(e);
    this.dragFrom = null;
    if (this.data && Math.abs(to - from) > 4 && this.onZoom) {
      const x = this.xScale();
      const a = Math.round(x.toStep(Math.min(from, to)));
      const b = Math.round(x.toStep(Math.max(from, to)));
      this.onZoom(Math.max(a, this.data.domain[0]), Math.min(b, this.data.domain[1]));
    } else {
      this.draw();
    }
  }
}
