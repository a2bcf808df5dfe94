// The dashboard: owns the view state (state.js, mirrored in the URL hash),
// asks the routes (api.js) and hands the answers to the banner, the
// timelines (one per selected run) and the charts of the selected tensor.

import * as api from "./api.js";
import { renderBanners } from "./banner.js";
import { RunPicker, SafeRangeForm, ZoomForm } from "./controls.js";
import { el, replace } from "./dom.js";
import * as fmt from "./format.js";
import * as rules from "./rules.js";
import * as store from "./state.js";
import { TensorCharts } from "./tensor_charts.js";
import { watchTheme } from "./theme.js";
import { Timeline, legend } from "./timeline.js";

// Runs shown when the link names none: enough to compare, few enough to stay fast.
const DEFAULT_RUNS = 4;
// How often to ask again while the server is still reading a grown run.
const STALE_POLL_MS = 2000;
const EMPTY_MESSAGE =
  "No numerics in this logdir yet: call tb_numerics.log_numerics(...) in your training step " +
  "and point TensorBoard at its logdir.";

export class Dashboard {
  constructor(root) {
    this.state = store.read();
    this.summaries = new Map(); // run -> /summary
    this.timelines = new Map(); // run -> Timeline
    this.series = new Map(); // request key -> Promise of /series
    this.generation = 0; // bumped per load so stale answers are dropped
    this.chartGeneration = 0;

    this.runPicker = new RunPicker((runs) => this.setRuns(runs));
    this.safeForm = new SafeRangeForm((params) => this.setParams(params));
    this.zoom = new ZoomForm((a, b) => this.setZoom(a, b));
    this.charts = new TensorCharts({
      onZoom: (a, b) => this.setZoom(a, b),
      onLogChange: (log) => {
        this.state.log = log;
        this.charts.setLog(log);
        store.write(this.state);
        this.loadCharts();
      },
    });
    this.charts.setLog(this.state.log);
    const reload = el("button", { type: "button", title: "Read the logdir again", onclick: () => this.load() }, "Reload");
    this.busy = el("div", { class: "loading-line", role: "status" });
    this.status = el(
      "div",
      { class: "status loading", role: "status" },
      "Loading numerics… (the first look at a long run reads every record; later looks are fast)"
    );
    this.banners = el("div", { class: "banners" });
    this.timelineHost = el("div", {});
    this.selectedName = el("h2", { class: "selected-name" });
    this.main = el(
      "div",
      { hidden: true },
      this.banners,
      el("section", { class: "timeline-block" }, el("div", { class: "timeline-head" }, el("h2", {}, "Health timeline"), legend()), this.timelineHost),
      el("section", {}, el("div", { class: "charts-head" }, this.selectedName, this.zoom.element), this.charts.element)
    );
    root.append(
      el(
        "div",
        { class: "numerics" },
        el("div", { class: "toolbar" }, this.runPicker.element, this.safeForm.element, el("div", {}, reload)),
        this.busy,
        this.status,
        this.main
      )
    );
    this.safeForm.set(this.state.params);
  }

  async start() {
    watchTheme(() => this.redraw());
    window.addEventListener("hashchange", () => {
      // A pasted or edited link: take its state as a whole.
      this.state = store.read(this.safeForm.keys());
      this.safeForm.set(this.state.params);
      this.charts.setLog(this.state.log);
      this.load();
    });
    let lastWidth = 0;
    new ResizeObserver(() => {
      const width = this.timelineHost.clientWidth;
      if (width === lastWidth) return;
      lastWidth = width;
      this.redraw();
      clearTimeout(this.resizeTimer);
      this.resizeTimer = setTimeout(() => this.refetchNarrowTimelines(), 300);
    }).observe(this.timelineHost);
    try {
      await rules.load(); // the words, codes and number format every view uses
    } catch (e) {
      return this.fail(e);
    }
    await this.readSafeRangeKeys();
    await this.load();
  }

  // ------------------------------------------------------------- loading

  /**
   * The form's fields from /safe_range, and the link's values of every
   * parameter it publishes. Without an answer the fields of state.js stay;
   * the routes' own errors then say what is wrong.
   */
  async readSafeRangeKeys() {
    try {
      this.safeForm.setDefaults(await api.safeRange());
    } catch {
      return;
    }
    this.state.params = store.read(this.safeForm.keys()).params;
    this.safeForm.set(this.state.params);
  }

  showStatus(kind, text) {
    this.status.className = `status ${kind}`;
    this.status.textContent = text;
    this.status.hidden = false;
  }

  async load() {
    const gen = ++this.generation;
    this.series.clear();
    this.busy.textContent = "Loading…";
    let runs;
    try {
      ({ runs } = await api.runs(this.state.params));
    } catch (e) {
      if (gen !== this.generation) return;
      this.busy.textContent = "";
      return this.fail(e);
    }
    if (gen !== this.generation) return;
    this.safeForm.set(this.state.params);
    if (!runs.length) {
      this.busy.textContent = "";
      this.main.hidden = true;
      this.runPicker.set([], []);
      return this.showStatus("empty", EMPTY_MESSAGE);
    }
    const names = runs.map((r) => r.run);
    let selected = this.state.runs.filter((r) => names.includes(r));
    if (!selected.length) selected = names.slice(0, DEFAULT_RUNS);
    this.state.runs = selected;
    this.runPicker.set(runs, selected);
    await this.loadRuns(gen);
  }

  /**
   * An error: the server's message, and the safe-range field it names marked
   * (its messages start with the name). What was shown under the previous
   * parameters is hidden: it no longer matches the form.
   */
  fail(e) {
    const keys = this.safeForm.keys();
    const invalid = keys.find((k) => e.message.startsWith(`${k} `)) || keys.find((k) => e.message.includes(k)) || null;
    this.safeForm.set(this.state.params, invalid);
    this.main.hidden = true;
    this.showStatus("error", `Error: ${e.message}`);
  }

  async loadRuns(gen = ++this.generation) {
    const { runs, params } = this.state;
    this.busy.textContent = "Loading…";
    // Summaries and timelines are asked for together: the timeline needs only
    // the run and its width, which the (empty) timeline block gives.
    this.main.hidden = false;
    replace(this.banners);
    this.buildTimelines();
    const summaries = Promise.all(
      runs.map((run) =>
        api.summary(run, params).then(
          (summary) => ({ run, summary }),
          (e) => ({ run, error: e.message })
        )
      )
    );
    const timelines = this.loadTimelines(gen, summaries);
    const items = await summaries;
    if (gen !== this.generation) return;
    this.summaries = new Map(items.filter((i) => i.summary).map((i) => [i.run, i.summary]));
    this.status.hidden = true;
    renderBanners(this.banners, items, (run, tensors, step) => this.showMe(run, tensors, step));
    if (!this.summaries.has(this.state.focus)) {
      const withAnomaly = runs.find((r) => this.summaries.get(r)?.first_anomaly);
      // A link's tensor is kept when the new focus run has it (pickDefaultSelection checks).
      this.state.focus = withAnomaly || runs.find((r) => this.summaries.has(r)) || null;
    }
    await timelines;
    if (gen !== this.generation) return;
    this.busy.textContent = "";
    this.pickDefaultSelection();
    this.applySelection();
    this.followStale(gen, items);
  }

  /**
   * A big run that grew is answered from its previous records while the
   * server reads the new ones ("stale"): say so, and ask again until the
   * answer is complete, unless the user has moved on (a newer generation).
   */
  followStale(gen, items) {
    const stale = items.filter((i) => i.summary && i.summary.stale);
    if (!stale.length) return;
    this.busy.textContent = "Updating: " + stale
      .map((i) => `${i.run} read up to step ${fmt.count(i.summary.as_of_step ?? 0)} of ${fmt.count(i.summary.latest_step ?? 0)}`)
      .join("; ") + "…";
    setTimeout(() => {
      if (gen === this.generation) this.loadRuns();
    }, STALE_POLL_MS);
  }

  buildTimelines() {
    this.timelines = new Map();
    const blocks = [];
    for (const run of this.state.runs) {
      const tl = new Timeline(run, {
        onSelect: (row, col) => this.selectCell(run, row, col),
        describeCell: (row, col) => this.describeCell(run, row, col),
      });
      this.timelines.set(run, tl);
      const error = el("p", { class: "error", hidden: true });
      tl.errorLine = error;
      blocks.push(
        el(
          "div",
          { class: "timeline-run", dataset: { run } },
          this.state.runs.length > 1 ? el("h3", { class: "tensor-name" }, run) : null,
          error,
          tl.element
        )
      );
    }
    replace(this.timelineHost, blocks);
  }

  /** Fills every timeline; the first anomaly's cell comes from the summaries once they are in. */
  async loadTimelines(gen, summaries = null) {
    const range = { start: this.state.start, end: this.state.end };
    await Promise.all(
      [...this.timelines].map(async ([run, tl]) => {
        const width = Math.min(10000, tl.plotWidth());
        try {
          const data = await api.timeline(run, width, range, this.state.params);
          await summaries;
          if (gen !== this.generation) return;
          tl.requestedWidth = width;
          tl.errorLine.hidden = true;
          const a = this.summaries.get(run)?.first_anomaly;
          tl.setData(data, a ? a.row : null, a ? a.step : null);
          tl.setActions(this.summaries.get(run)?.actions?.events);
        } catch (e) {
          tl.errorLine.hidden = false;
          tl.errorLine.textContent = `Timeline: ${e.message}`;
        }
      })
    );
  }

  async refetchNarrowTimelines() {
    const stale = [...this.timelines.values()].some((tl) => tl.requestedWidth && Math.abs(tl.plotWidth() - tl.requestedWidth) > 0.2 * tl.requestedWidth);
    if (!stale) return;
    const gen = this.generation;
    await this.loadTimelines(gen);
    this.applySelection(false);
  }

  // ------------------------------------------------------------- selection

  /** The link's tensor if the run has it, else the first anomaly, the first warning, the first row. */
  pickDefaultSelection() {
    const run = this.state.focus;
    const tl = this.timelines.get(run);
    if (!tl || !tl.data) return;
    if (this.state.tensor !== null && tl.rowOf(this.state.tensor) >= 0) return;
    const s = this.summaries.get(run);
    const pick = s.first_anomaly || s.first_warning;
    this.state.tensor = pick ? pick.tensor : tl.data.rows[0]?.tensor ?? null;
    this.state.step = pick ? pick.step : null;
  }

  /** The step range in the zoom form, with the run's whole range as placeholders. */
  showZoom() {
    const s = this.summaries.get(this.state.focus);
    this.zoom.set(this.state.start, this.state.end, s ? [s.first_step, s.last_step] : []);
  }

  applySelection(charts = true) {
    store.write(this.state);
    this.showZoom();
    for (const [run, tl] of this.timelines) {
      tl.select(run === this.state.focus ? this.state.tensor : null, this.state.step);
    }
    if (charts) this.loadCharts();
  }

  select(run, tensor, step) {
    Object.assign(this.state, { focus: run, tensor, step });
    this.applySelection();
  }

  /**
   * A banner's "Show me": the first of `tensors` that the run's timeline has
   * (an op's own row before its layer's), zoomed out if the step is outside
   * the range, selected and scrolled to.
   */
  async showMe(run, tensors, step) {
    const tl = this.timelines.get(run);
    const tensor = tensors.find((t) => tl && tl.rowOf(t) >= 0) ?? tensors[tensors.length - 1];
    const { start, end } = this.state;
    Object.assign(this.state, { focus: run, tensor, step });
    if ((start !== null && step < start) || (end !== null && step > end)) {
      await this.setZoom(null, null);
    } else {
      this.applySelection();
    }
    if (tl) {
      tl.element.scrollIntoView({ block: "nearest" });
      tl.canvas.focus({ preventScroll: true });
    }
  }

  /** A clicked cell: the tensor, and the step in its bucket that is worst (first of them). */
  async selectCell(run, row, col) {
    const tl = this.timelines.get(run);
    const tensor = tl.data.rows[row].tensor;
    const start = tl.data.bucket_start[col];
    const end = tl.data.bucket_end[col];
    let step = start;
    if (end > start) {
      try {
        const s = await this.getSeries(run, tensor, { start, end, maxPoints: 100000 });
        const worst = Math.max(...s.health);
        if (s.steps.length) step = s.steps[s.health.indexOf(worst)];
      } catch {
        // keep the bucket's first step
      }
    }
    this.select(run, tensor, step);
  }

  async describeCell(run, row, col) {
    const tl = this.timelines.get(run);
    const tensor = tl.data.rows[row].tensor;
    const start = tl.data.bucket_start[col];
    const end = tl.data.bucket_end[col];
    const s = await this.getSeries(run, tensor, { start, end, maxPoints: 1 });
    if (!s.steps.length) return ["No record in this range"];
    const f = s.fields;
    const n = fmt.number;
    const lines = [
      `min ${n(f.min[0])} · max ${n(f.max[0])} · max |x| ${n(f.max_abs[0])}`,
      `mean ${n(f.mean[0])} · std ${n(f.std[0])} · L2 ${n(f.l2[0])}`,
    ];
    if (f.nan[0] + f.posinf[0] + f.neginf[0] > 0) {
      lines.push(fmt.nonfiniteCounts({ nan: f.nan[0], posinf: f.posinf[0], neginf: f.neginf[0], size: f.count[0] }));
    }
    const kind = s.kinds && s.kinds[0];
    if (kind) lines.unshift(`${this.isInfoKind(run, kind) ? "information" : "warning"}: ${fmt.kind(kind)}`);
    if (end > start) lines.push("(over the bucket: min of mins, max of maxes, sums of counts)");
    return lines;
  }

  /** Whether the run's summary lists `kind` as a handled event (information, not a warning). */
  isInfoKind(run, kind) {
    const info = this.summaries.get(run)?.info;
    return Array.isArray(info) && info.some((i) => i && i.kind === kind);
  }

  getSeries(run, tensor, range) {
    const key = JSON.stringify([run, tensor, range.start, range.end, range.maxPoints, this.state.params]);
    if (!this.series.has(key)) {
      if (this.series.size > 500) this.series.clear();
      const p = api.series(run, tensor, range, this.state.params);
      p.catch(() => this.series.delete(key));
      this.series.set(key, p);
    }
    return this.series.get(key);
  }

  async loadCharts() {
    const gen = ++this.chartGeneration;
    const { focus: run, tensor, start, end, step, log } = this.state;
    const s = this.summaries.get(run);
    const tl = this.timelines.get(run);
    if (!s || !tl || !tl.data || tensor === null) {
      replace(this.selectedName, "Select a tensor in the timeline");
      return this.charts.message("Nothing selected.");
    }
    const info = tl.data.rows[tl.rowOf(tensor)];
    replace(
      this.selectedName,
      el("span", { class: "tensor-name", title: tensor }, tensor),
      info ? ` · ${[info.op_type, info.phase, info.role, info.dtype].filter(Boolean).join(", ")}` : "",
      this.state.runs.length > 1 ? ` · run ${run}` : ""
    );
    const range = { start: start ?? undefined, end: end ?? undefined };
    const globalOf = (r) => {
      const row = this.timelines.get(r)?.data?.rows.find((x) => x.role === "global_norm");
      return row ? this.getSeries(r, row.tensor, range) : null;
    };
    // Up to three other selected runs that logged this tensor, to compare.
    const otherRuns = this.state.runs.filter((r) => r !== run && this.timelines.get(r)?.rowOf(tensor) >= 0).slice(0, 3);
    const others = Promise.all(
      otherRuns.map(async (r) => {
        const [series, globalSeries] = await Promise.all([this.getSeries(r, tensor, range), globalOf(r)]).catch(() => [null, null]);
        return { run: r, series, globalSeries };
      })
    );
    try {
      const [series, globalSeries, compared] = await Promise.all([this.getSeries(run, tensor, range), globalOf(run), others]);
      if (gen !== this.chartGeneration) return;
      this.charts.set({
        series,
        globalSeries,
        domain: [start ?? s.first_step, end ?? s.last_step],
        anomalyStep: s.first_anomaly ? s.first_anomaly.step : null,
        selectedStep: step,
        log,
        others: compared,
      });
    } catch (e) {
      if (gen === this.chartGeneration) this.charts.message(`Error: ${e.message}`);
    }
  }

  // ------------------------------------------------------------- controls

  setRuns(runs) {
    this.state.runs = runs;
    if (!runs.includes(this.state.focus)) Object.assign(this.state, { focus: null, tensor: null, step: null });
    store.write(this.state);
    if (!runs.length) {
      this.main.hidden = true;
      return this.showStatus("empty", "Select a run to see its numerics.");
    }
    this.loadRuns();
  }

  setParams(params) {
    this.state.params = params;
    store.write(this.state);
    this.load();
  }

  async setZoom(start, end) {
    if (start !== null && end !== null && start > end) [start, end] = [end, start];
    if (start !== null && start < 0) start = 0;
    Object.assign(this.state, { start, end });
    store.write(this.state);
    this.showZoom(); // at once, with the link: the timelines follow when read
    const gen = ++this.generation;
    this.busy.textContent = "Loading…";
    await this.loadTimelines(gen);
    if (gen !== this.generation) return;
    this.busy.textContent = "";
    this.applySelection();
  }

  redraw() {
    for (const tl of this.timelines.values()) tl.draw();
    this.charts.redraw();
  }
}
