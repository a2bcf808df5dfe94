// The health timeline of one run: one row per tensor in execution order,
// grouped by phase and role, op-level rows under their layer (rows.js), one
// column per step bucket (/timeline already keeps the worst health of each
// bucket, so one bad step always shows). Labels are HTML (ellipsis, full
// name in the title); cells are a canvas.

import { niceTicks } from "./chart.js";
import { el, replace } from "./dom.js";
import * as fmt from "./format.js";
import * as rules from "./rules.js";
import { orderRows } from "./rows.js";
import { color } from "./theme.js";

const AXIS_H = 22;
const ROW_H = 14;
const GROUP_H = 18;
// The mark over a column where training acted (summary.actions).
const ACTION_GLYPHS = { skip: "S", rewind: "R", stop: "X" };
/** The legend of the cell colours (a health's name is its colour), once the rules are loaded. */
export function legend() {
  const box = el("div", { class: "legend", "aria-label": "Timeline colours" });
  rules.ready.then(() =>
    replace(box, ...rules.healths().map((h) => el("span", {}, el("span", { class: "swatch", style: `background: var(--${h.name})` }), h.words)))
  );
  return box;
}

export class Timeline {
  /**
   * onSelect(rowIndex, col): a cell was clicked or chosen with Enter.
   * describeCell(rowIndex, col): Promise of extra tooltip lines (numbers).
   */
  constructor(run, { onSelect, describeCell }) {
    this.run = run;
    this.onSelect = onSelect;
    this.describeCell = describeCell;
    this.data = null;
    this.anomaly = null; // {row, col}
    this.selected = null; // {row, col}
    this.cursor = null; // keyboard position {row, col}
    this.hoverToken = 0;

    this.labels = el("div", { class: "labels" });
    this.canvas = el("canvas", {
      tabindex: "0",
      // A custom keyboard widget: arrows move, Enter selects; the live region reads each cell.
      role: "application",
      "aria-label": `Health timeline of run ${run}: arrow keys move, Enter selects`,
    });
    this.live = el("div", { class: "sr-only", "aria-live": "polite" });
    this.tooltip = el("div", { class: "tooltip", hidden: true, role: "tooltip" });
    this.actions = []; // [{step, action, detail}]: where training acted on an anomaly
    this.actionMarks = el("div", { class: "action-marks" });
    this.element = el("div", { class: "timeline" }, this.labels, el("div", { class: "cells" }, this.canvas, this.actionMarks), this.live, this.tooltip);

    this.canvas.addEventListener("mousemove", (e) => this.hover(e));
    this.canvas.addEventListener("mouseleave", () => this.hideTooltip());
    this.canvas.addEventListener("click", (e) => {
      const cell = this.cellAt(e);
      if (cell) this.choose(cell);
    });
    this.canvas.addEventListener("keydown", (e) => this.key(e));
    this.canvas.addEventListener("blur", () => {
      this.hideTooltip();
      this.draw();
    });
  }

  /** Width in CSS pixels available to the cells: the /timeline width to ask for. */
  plotWidth() {
    return Math.max(50, Math.floor(this.canvas.parentElement.clientWidth || 600));
  }

  /** /timeline's answer; the first anomaly's tensor and step (or null) are marked. */
  setData(data, anomalyTensor, anomalyStep) {
    this.data = { ...data, rows: orderRows(data.rows) };
    this.cols = data.bucket_start.length;
    this.anomaly = anomalyTensor === null ? null : this.cellOf(this.rowOf(anomalyTensor), anomalyStep);
    this.layout();
    this.draw();
  }

  /** The steps where training skipped, rewound or stopped (summary.actions.events), marked over their columns. */
  setActions(events) {
    this.actions = Array.isArray(events) ? events.filter((e) => e && Number.isInteger(e.step) && typeof e.action === "string") : [];
    this.drawActions();
  }

  /** One mark per action over its step's column, its words as the title (text, never HTML). */
  drawActions() {
    if (!this.data || !this.cellWidth) return replace(this.actionMarks);
    const marks = [];
    for (const e of this.actions) {
      const col = this.colOf(e.step);
      if (col === null) continue;
      const words = `Step ${fmt.count(e.step)}: ${e.action}${typeof e.detail === "string" ? ` (${e.detail})` : ""}`;
      marks.push(
        el("span", { class: `action-mark ${e.action}`, title: words, "aria-label": words, style: `left:${(col + 0.5) * this.cellWidth}px`, dataset: { step: e.step } }, ACTION_GLYPHS[e.action] ?? "?")
      );
    }
    replace(this.actionMarks, marks);
  }

  /** The bucket column holding a step, or null when out of range. */
  colOf(step) {
    const starts = this.data.bucket_start;
    if (!starts.length || step === null || step < starts[0] || step > this.data.bucket_end[starts.length - 1]) return null;
    let lo = 0;
    let hi = starts.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (starts[mid] <= step) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }

  /** {row, col} of a step in a row (col null when out of range), or null for a bad row. */
  cellOf(row, step) {
    if (!this.data || row === null || row < 0 || row >= this.data.rows.length) return null;
    return { row, col: this.colOf(step) };
  }

  rowOf(tensor) {
    return this.data ? this.data.rows.findIndex((r) => r.tensor === tensor) : -1;
  }

  /** Marks the selected tensor and step (null clears). */
  select(tensor, step) {
    const row = this.rowOf(tensor);
    this.selected = row < 0 ? null : this.cellOf(row, step);
    if (this.selected && this.selected.col !== null) this.cursor = { ...this.selected };
    for (const label of this.labels.querySelectorAll(".label.row")) {
      label.classList.toggle("selected", Number(label.dataset.row) === row);
    }
    this.draw();
  }

  layout() {
    const rows = this.data.rows;
    this.rowY = [];
    const labels = [];
    let y = AXIS_H;
    let group = null;
    rows.forEach((r, i) => {
      // An op nested under its layer stays in the layer's group.
      const g = r.nested ? group : `${r.phase} · ${r.role}`;
      if (g !== group) {
        group = g;
        labels.push(el("div", { class: "label group", style: `top:${y}px;height:${GROUP_H}px;line-height:${GROUP_H + 4}px` }, g));
        y += GROUP_H;
      }
      this.rowY.push(y);
      const name = r.op_type ? `${r.tensor} (${r.op_type})` : r.tensor;
      labels.push(
        el("div", { class: r.nested ? "label row nested" : "label row", title: name, dataset: { row: i }, style: `top:${y}px;height:${ROW_H}px;line-height:${ROW_H}px` }, r.tensor)
      );
      y += ROW_H;
    });
    this.height = y + 4;
    this.labels.style.height = `${this.height}px`;
    replace(this.labels, labels);
  }

  draw() {
    if (!this.data) return;
    const width = this.plotWidth();
    const dpr = window.devicePixelRatio || 1;
    this.canvas.width = Math.round(width * dpr);
    this.canvas.height = Math.round(this.height * dpr);
    this.canvas.style.height = `${this.height}px`;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, this.height);
    const cw = this.cols ? width / this.cols : width;
    this.cellWidth = cw;
    const palette = Object.fromEntries(rules.healths().map((h) => [h.code, color(h.name)]));

    this.drawAxis(ctx, width, cw);
    // Cells, merged into runs of equal health so 2,000 columns stay cheap.
    this.data.rows.forEach((row, r) => {
      const y = this.rowY[r] + 1;
      const cells = row.cells;
      let start = 0;
      for (let i = 1; i <= cells.length; i++) {
        if (i === cells.length || cells[i] !== cells[start]) {
          ctx.fillStyle = palette[cells[start]];
          const x0 = Math.floor(start * cw);
          ctx.fillRect(x0, y, Math.max(1, Math.floor(i * cw) - x0), ROW_H - 2);
          start = i;
        }
      }
    });
    if (this.anomaly && this.anomaly.col !== null) this.mark(ctx, this.anomaly, color("anomaly-mark"), 2, []);
    if (this.selected && this.selected.col !== null) this.mark(ctx, this.selected, color("accent"), 3, []);
    if (this.cursor && document.activeElement === this.canvas) this.mark(ctx, this.cursor, color("fg"), 1.5, [3, 2]);
    this.drawActions();
  }

  drawAxis(ctx, width, cw) {
    const starts = this.data.bucket_start;
    ctx.fillStyle = color("muted");
    ctx.strokeStyle = color("grid");
    ctx.font = "11px Roboto, Arial, sans-serif";
    ctx.textBaseline = "middle";
    if (!starts.length) return;
    // Ticks at round steps, placed inside their bucket.
    const ends = this.data.bucket_end;
    const first = starts[0];
    const last = ends[ends.length - 1];
    // Steps need not be evenly spread (a gap, several trainings in one run):
    // a label that would overlap the one before it is left out.
    let free = 0;
    for (const t of niceTicks(first, last, Math.max(2, Math.floor(width / 90)))) {
      if (!Number.isInteger(t) || t < first || t > last) continue;
      const col = this.colOf(t);
      if (col === null) continue;
      const x = (col + Math.min(1, (t - starts[col]) / (ends[col] - starts[col] + 1))) * cw;
      const text = fmt.count(t);
      const w = ctx.measureText(text).width;
      if (x < free || x + w + 2 >= width) continue;
      ctx.fillRect(Math.floor(x), AXIS_H - 5, 1, 5);
      ctx.fillText(text, x + 2, AXIS_H / 2 - 1);
      free = x + w + 8;
    }
    if (this.anomaly && this.anomaly.col !== null) {
      // A triangle over the first anomaly's column, visible when its row is scrolled away.
      const x = (this.anomaly.col + 0.5) * cw;
      ctx.fillStyle = color("nonfinite");
      ctx.beginPath();
      ctx.moveTo(x - 5, AXIS_H - 9);
      ctx.lineTo(x + 5, AXIS_H - 9);
      ctx.lineTo(x, AXIS_H - 1);
      ctx.fill();
    }
  }

  /** An outline around a cell, at least 6 px wide so a 1-px bucket shows. */
  mark(ctx, { row, col }, stroke, lineWidth, dash) {
    const cw = this.cellWidth;
    const w = Math.max(6, cw);
    const x = (col + 0.5) * cw - w / 2;
    ctx.save();
    ctx.strokeStyle = stroke;
    ctx.lineWidth = lineWidth;
    ctx.setLineDash(dash);
    ctx.strokeRect(x, this.rowY[row] - 1, w, ROW_H + 2);
    ctx.restore();
  }

  cellAt(e) {
    if (!this.data || !this.cols) return null;
    const rect = this.canvas.getBoundingClientRect();
    const x = e.clientX - rect.left;
    const y = e.clientY - rect.top;
    const row = this.rowY.findIndex((top) => y >= top && y < top + ROW_H);
    if (row < 0) return null;
    const col = Math.min(this.cols - 1, Math.max(0, Math.floor(x / this.cellWidth)));
    return { row, col };
  }

  choose(cell) {
    this.cursor = cell;
    this.onSelect(cell.row, cell.col);
  }

  key(e) {
    if (!this.data || !this.cols) return;
    const c = this.cursor || this.selected || this.anomaly || { row: 0, col: 0 };
    let { row } = c;
    let col = c.col ?? 0;
    const moves = {
      ArrowLeft: () => (col = Math.max(0, col - 1)),
      ArrowRight: () => (col = Math.min(this.cols - 1, col + 1)),
      ArrowUp: () => (row = Math.max(0, row - 1)),
      ArrowDown: () => (row = Math.min(this.data.rows.length - 1, row + 1)),
      PageUp: () => (col = Math.max(0, col - 10)),
      PageDown: () => (col = Math.min(this.cols - 1, col + 10)),
      Home: () => (col = 0),
      End: () => (col = this.cols - 1),
    };
    if (moves[e.key]) {
      moves[e.key]();
      this.cursor = { row, col };
      this.scrollToRow(row);
      this.draw();
      this.showCell(this.cursor, null);
      e.preventDefault();
    } else if (e.key === "Enter" || e.key === " ") {
      this.choose({ row, col });
      e.preventDefault();
    }
  }

  /** Scrolls the timeline's box (not the page) so that the selected row is in its middle. */
  revealSelected() {
    if (!this.selected || !this.rowY) return;
    const box = this.element;
    box.scrollTop = Math.max(0, this.rowY[this.selected.row] - (box.clientHeight - ROW_H) / 2);
  }

  /** Keeps a row inside the timeline's scroll box (long runs have many rows). */
  scrollToRow(row) {
    const box = this.element;
    const top = this.rowY[row];
    if (top < box.scrollTop) box.scrollTop = top - GROUP_H;
    else if (top + ROW_H > box.scrollTop + box.clientHeight) box.scrollTop = top + ROW_H - box.clientHeight + 4;
  }

  hover(e) {
    const cell = this.cellAt(e);
    if (!cell) return this.hideTooltip();
    if (this.hovered && this.hovered.row === cell.row && this.hovered.col === cell.col) {
      return this.place(e.clientX, e.clientY);
    }
    this.hovered = cell;
    this.showCell(cell, [e.clientX, e.clientY]);
  }

  /** Tooltip (and screen-reader line) for a cell; numbers follow from the server. */
  showCell(cell, at) {
    const row = this.data.rows[cell.row];
    const code = row.cells[cell.col];
    const range = fmt.steps(this.data.bucket_start[cell.col], this.data.bucket_end[cell.col]);
    const words = rules.health(code).words;
    const noRecord = code === rules.code("nodata");
    const head = `${row.tensor}, step ${range}: ${words}`;
    this.live.textContent = head;
    const numbers = el("div", { class: "numbers" }, noRecord ? "" : "…");
    replace(
      this.tooltip,
      el("div", { class: "tensor-name" }, row.tensor),
      el("div", {}, `${range.includes("–") ? "Steps" : "Step"} ${range} · ${words}`),
      numbers
    );
    this.tooltip.hidden = false;
    if (at) this.place(...at);
    else {
      const rect = this.canvas.getBoundingClientRect();
      this.place(rect.left + (cell.col + 1) * this.cellWidth, rect.top + this.rowY[cell.row] + ROW_H);
    }
    if (noRecord) return;
    const token = ++this.hoverToken;
    clearTimeout(this.hoverTimer);
    this.hoverTimer = setTimeout(async () => {
      let lines;
      try {
        lines = await this.describeCell(cell.row, cell.col);
      } catch (err) {
        lines = [err.message];
      }
      if (token === this.hoverToken && !this.tooltip.hidden) replace(numbers, lines.map((l) => el("div", {}, l)));
    }, 120);
  }

  place(x, y) {
    const tip = this.tooltip;
    const w = tip.offsetWidth;
    const h = tip.offsetHeight;
    const left = x + 14 + w > window.innerWidth ? Math.max(0, x - 14 - w) : x + 14;
    const top = y + 14 + h > window.innerHeight ? Math.max(0, y - 14 - h) : y + 14;
    tip.style.left = `${left}px`;
    tip.style.top = `${top}px`;
  }

  hideTooltip() {
    this.hovered = null;
    this.hoverToken++;
    this.tooltip.hidden = true;
  }
}
