// The dashboard: owns the view state (state.js, kept in TensorBoard's URL
// through host.js), asks the routes (api.js) and hands the answers to the
// banner, the comparison with a reference run, the timeline of the run and
// the charts of the selected tensor. One run is shown at a time; another run
// can be picked as its reference.

import * as api from "./api.js";
import { renderBanners } from "./banner.js";
import { renderComparison } from "./compare_view.js";
import { RunSelect, SafeRangeForm, ZoomForm } from "./controls.js";
import { describeCell } from "./describe.js";
import { el, replace } from "./dom.js";
import * as fmt from "./format.js";
import { Host, runColour } from "./host.js";
import * as rules from "./rules.js";
import * as store from "./state.js";
import { TensorCharts } from "./tensor_charts.js";
import { watchTheme } from "./theme.js";
import { Timeline, legend } from "./timeline.js";

// How often to ask again while the server is still reading a grown run.
const STALE_POLL_MS = 2000;
const EMPTY_MESSAGE =
  "No numerics in this logdir yet: call tb_numerics.log_numerics(...) in your training step " +
  "and point TensorBoard at its logdir.";

/**
 * The run to open on: the earliest first anomaly, else the earliest first
 * warning, else the first run with records (one whose files could not be
 * read at all is listed, not opened first), else the first.
 */
export function defaultRun(runs) {
  const earliest = (key) => {
    const with_ = runs.filter((r) => r[key] !== null && r[key] !== undefined);
    return with_.length ? with_.reduce((a, b) => (b[key] < a[key] ? b : a)).run : null;
  };
  return (
    earliest("first_anomaly_step") ?? earliest("first_warning_step") ?? (runs.find((r) => r.records > 0) ?? runs[0])?.run ?? null
  );
}

export class Dashboard {
  constructor(root) {
    this.state = store.emptyState();
    this.host = null;
    this.runList = []; // /runs
    this.tbRuns = null; // TensorBoard's run names, in the order of its colours
    this.tbRunsAsked = Promise.resolve(null);
    this.summary = null; // /summary of the run shown
    this.timeline = null;
    this.invalid = {}; // safe-range parameter -> the server's message: left out of requests
    this.series = new Map(); // request key -> Promise of /series
    this.generation = 0; // bumped per load so stale answers are dropped
    this.chartGeneration = 0;
    this.build(root);
  }

  build(root) {
    this.runSelect = new RunSelect("Run", (run) => this.setRun(run));
    this.compareSelect = new RunSelect("Compare with", (run) => this.setCompare(run), { none: "no other run" });
    this.safeForm = new SafeRangeForm((params) => this.setParams(params));
    this.zoom = new ZoomForm((a, b) => this.setZoom(a, b));
    this.charts = new TensorCharts({
      onZoom: (a, b) => this.setZoom(a, b),
      onLogChange: (log) => {
        this.state.log = log;
        this.charts.setLog(log);
        this.save();
        this.loadCharts();
      },
    });
    // TensorBoard's own reload button drives the tab (host.js); alone, the page has its own.
    this.reloadButton = el("button", { type: "button", title: "Read the logdir again", onclick: () => this.load() }, "Reload");
    this.busy = el("div", { class: "loading-line", role: "status" });
    this.status = el("div", { class: "status loading", role: "status" }, "Loading numerics… (the first look at a long run reads every record; later looks are fast)");
    this.banners = el("div", { class: "banners" });
    this.comparison = el("div", { class: "comparison", hidden: true });
    this.timelineHost = el("div", {});
    this.selectedName = el("h2", { class: "selected-name" });
    this.main = el(
      "div",
      { hidden: true },
      this.banners,
      this.comparison,
      el("section", { class: "timeline-block" }, el("div", { class: "timeline-head" }, el("h2", {}, "Health timeline"), legend()), this.timelineHost),
      el("section", { class: "charts-block" }, el("div", { class: "charts-head" }, this.selectedName, this.zoom.element), this.charts.element)
    );
    const toolbar = el("div", { class: "toolbar" }, this.runSelect.element, this.compareSelect.element, this.safeForm.toggle, this.reloadButton);
    root.append(el("div", { class: "numerics" }, toolbar, this.safeForm.panel, this.busy, this.status, this.main));
  }

  async start() {
    this.host = Host.connect();
    this.reloadButton.hidden = this.host !== null;
    const [fromHost, , rulesError] = await Promise.all([
      this.host ? this.host.urlData() : null,
      this.readSafeRangeKeys(),
      rules.load().then(() => null, (e) => e), // the words, codes and number format every view uses
    ]);
    if (rulesError) return this.fail(rulesError);
    this.takeState(fromHost && Object.keys(fromHost).length ? fromHost : null);
    // Run colours have a dark variant: compared charts are drawn again.
    watchTheme(() => (this.state.compare ? this.loadCharts() : this.redraw()));
    window.addEventListener("hashchange", () => this.takeState(null, true));
    if (this.host) {
      this.host.on("experimental.DataReloaded", () => this.load());
      this.host.onUrlChange(async () => {
        const data = await this.host.urlData();
        if (data && store.serialize(store.fromDict(data, this.safeForm.keys())) !== store.serialize(this.state)) this.takeState(data, true);
      });
    }
    let lastWidth = 0;
    new ResizeObserver(() => {
      const width = this.timelineHost.clientWidth;
      if (width === lastWidth) return;
      lastWidth = width;
      this.redraw();
      clearTimeout(this.resizeTimer);
      this.resizeTimer = setTimeout(() => this.refetchNarrowTimeline(), 300);
    }).observe(this.timelineHost);
    await this.load();
  }

  /** A link's state as a whole: TensorBoard's URL data (a dict), else the frame's own hash. */
  takeState(dict, reload = false) {
    const keys = this.safeForm.keys();
    this.state = dict ? store.fromDict(dict, keys) : store.read(keys);
    this.invalid = {};
    this.safeForm.set(this.state.params);
    this.charts.setLog(this.state.log);
    if (reload) this.load();
  }

  /** The link of the view: the frame's hash, and TensorBoard's URL where it hosts the tab. */
  save() {
    store.write(this.state);
    if (this.host) this.host.writeUrlData(store.toDict(this.state));
  }

  // ------------------------------------------------------------- loading

  /** The form's fields from /safe_range; without an answer the fields of state.js stay. */
  async readSafeRangeKeys() {
    try {
      this.safeForm.setDefaults(await api.safeRange());
    } catch {
      // the routes' own errors then say what is wrong
    }
  }

  /** The safe-range parameters sent: the link's, less those the server refused. */
  requestParams() {
    return Object.fromEntries(Object.entries(this.state.params).filter(([k]) => !Object.hasOwn(this.invalid, k)));
  }

  /**
   * An error that names a safe-range parameter (the server's messages start
   * with its name): that field is marked and left out, and true is returned
   * so that the caller asks again with the rest.
   */
  refuse(e) {
    const keys = this.safeForm.keys().filter((k) => Object.hasOwn(this.state.params, k) && !Object.hasOwn(this.invalid, k));
    const key = keys.find((k) => e.message.startsWith(`${k} `)) || keys.find((k) => e.message.includes(k));
    if (!key) return false;
    this.invalid[key] = e.message;
    this.safeForm.set(this.state.params, this.invalid);
    return true;
  }

  showStatus(kind, text) {
    this.status.className = `status ${kind}`;
    this.status.textContent = text;
    this.status.hidden = false;
  }

  fail(e) {
    this.main.hidden = true;
    this.showStatus("error", `Error: ${e.message}`);
  }

  async load() {
    const gen = ++this.generation;
    this.series.clear();
    this.busy.textContent = "Loading…";
    // TensorBoard's run list (its colours' order) is asked beside, never waited for before the banner.
    if (this.host) this.tbRunsAsked = this.host.runs().then((r) => (this.tbRuns = r));
    let runs;
    try {
      ({ runs } = await api.runs(this.requestParams()));
    } catch (e) {
      if (gen !== this.generation) return;
      if (this.refuse(e)) return this.load();
      this.busy.textContent = "";
      return this.fail(e);
    }
    if (gen !== this.generation) return;
    this.runList = runs;
    if (!runs.length) {
      this.busy.textContent = "";
      this.main.hidden = true;
      this.runSelect.set([], null);
      this.compareSelect.set([], null);
      return this.showStatus("empty", EMPTY_MESSAGE);
    }
    const names = runs.map((r) => r.run);
    // A link's run that is gone (or none): the run whose first anomaly is earliest.
    if (!names.includes(this.state.run)) this.state.run = defaultRun(runs);
    if (!names.includes(this.state.compare) || this.state.compare === this.state.run) this.state.compare = null;
    this.runSelect.set(runs, this.state.run);
    this.compareSelect.set(runs, this.state.compare, this.state.run);
    await this.loadRun(gen);
  }

  async loadRun(gen = ++this.generation) {
    const { run, compare } = this.state;
    const params = this.requestParams();
    this.busy.textContent = "Loading…";
    this.main.hidden = false;
    // Summary, timeline and comparison are asked for together.
    const summary = api.summary(run, params);
    summary.catch(() => {});
    const timeline = this.loadTimeline(gen, summary.catch(() => null));
    this.loadComparison(gen, run, compare, params);
    try {
      this.summary = await summary;
    } catch (e) {
      if (gen !== this.generation) return;
      if (this.refuse(e)) return this.load();
      this.summary = null;
      renderBanners(this.banners, [{ run, error: e.message }], () => {});
    }
    if (gen !== this.generation) return;
    this.status.hidden = true;
    if (this.summary) renderBanners(this.banners, [{ run, summary: this.summary }], (r, tensors, step) => this.showMe(tensors, step));
    if (this.summary?.preliminary) this.busy.textContent = this.updatingWords(this.summary);
    await timeline;
    if (gen !== this.generation) return;
    // A first look at a long run: the selection waits for the whole run's summary.
    if (this.summary?.preliminary) return this.followStale(gen);
    this.busy.textContent = "";
    this.pickDefaultSelection();
    this.applySelection();
    this.followStale(gen);
  }

  /** The run against its reference (/compare), shown above the timeline. */
  async loadComparison(gen, run, compare, params) {
    if (!compare) {
      this.comparison.hidden = true;
      return;
    }
    let answer;
    try {
      answer = await api.compare(run, compare, params);
    } catch (e) {
      answer = { error: e.message };
    }
    if (gen !== this.generation) return;
    await this.tbRunsAsked;
    if (gen !== this.generation) return;
    this.comparison.hidden = false;
    renderComparison(this.comparison, answer, { run, compare, colours: [this.colourOf(run), this.colourOf(compare)] }, (tensor, step) => this.showMe([tensor], step));
  }

  /**
   * A big run that grew is answered from its previous records while the
   * server reads the new ones ("stale"): say so, and ask again until the
   * answer is complete, unless the user has moved on (a newer generation).
   */
  followStale(gen) {
    const s = this.summary;
    if (!s || !s.stale) return;
    this.busy.textContent = this.updatingWords(s);
    setTimeout(() => {
      if (gen === this.generation) this.loadRun();
    }, STALE_POLL_MS);
  }

  /** What the loading line says while a stale or first-look answer is being completed. */
  updatingWords(s) {
    return s.preliminary
      ? `Reading all of ${this.state.run} (to step ${fmt.count(s.latest_step ?? 0)}): the warnings and the timeline follow…`
      : `Updating: ${this.state.run} read up to step ${fmt.count(s.as_of_step ?? 0)} of ${fmt.count(s.latest_step ?? 0)}…`;
  }

  /** Fills the timeline; the first anomaly's cell comes from the summary once it is in. */
  async loadTimeline(gen, summary) {
    const run = this.state.run;
    if (!this.timeline || this.timeline.run !== run) this.buildTimeline(run);
    const tl = this.timeline;
    const width = Math.min(10000, tl.plotWidth());
    try {
      const data = await api.timeline(run, width, { start: this.state.start, end: this.state.end }, this.requestParams());
      const s = await summary;
      if (gen !== this.generation) return;
      tl.requestedWidth = width;
      tl.errorLine.hidden = true;
      const a = s?.first_anomaly;
      tl.setData(data, a ? a.tensor : null, a ? a.step : null);
      tl.setActions(s?.actions?.events);
    } catch (e) {
      tl.errorLine.hidden = false;
      tl.errorLine.textContent = `Timeline: ${e.message}`;
    }
  }

  buildTimeline(run) {
    const tl = new Timeline(run, {
      onSelect: (row, col) => this.selectCell(row, col),
      describeCell: (row, col) => this.describe(row, col),
    });
    tl.errorLine = el("p", { class: "error", hidden: true });
    this.timeline = tl;
    replace(this.timelineHost, el("div", { class: "timeline-run", dataset: { run } }, tl.errorLine, tl.element));
  }

  async refetchNarrowTimeline() {
    const tl = this.timeline;
    if (!tl || !tl.requestedWidth || Math.abs(tl.plotWidth() - tl.requestedWidth) <= 0.2 * tl.requestedWidth) return;
    await this.loadTimeline(this.generation, Promise.resolve(this.summary));
    this.applySelection(false);
  }

  // ------------------------------------------------------------- selection

  /** The link's tensor if the run has it, else the first anomaly, the first warning, the first row. */
  pickDefaultSelection() {
    const tl = this.timeline;
    if (!tl || !tl.data) return;
    if (this.state.tensor !== null && tl.rowOf(this.state.tensor) >= 0) return;
    const s = this.summary || {};
    const pick = s.first_anomaly || s.first_warning;
    this.state.tensor = pick ? pick.tensor : tl.data.rows[0]?.tensor ?? null;
    this.state.step = pick ? pick.step : null;
  }

  /** The step range in the zoom form, with the run's whole range as placeholders. */
  showZoom() {
    const s = this.summary;
    this.zoom.set(this.state.start, this.state.end, s ? [s.first_step, s.last_step] : []);
  }

  applySelection(charts = true) {
    this.save();
    this.showZoom();
    if (this.timeline) {
      this.timeline.select(this.state.tensor, this.state.step);
      // Scrolled to a newly selected row only: a reload keeps where the user scrolled.
      const key = JSON.stringify([this.state.run, this.state.tensor]);
      if (key !== this.revealed) this.timeline.revealSelected();
      this.revealed = key;
    }
    if (charts) this.loadCharts();
  }

  /**
   * A banner's "Show me": the first of `tensors` that the timeline has (an
   * op's own row before its layer's), zoomed out if the step is outside the
   * range, selected and focused.
   */
  async showMe(tensors, step) {
    const tl = this.timeline;
    const tensor = tensors.find((t) => tl && tl.rowOf(t) >= 0) ?? tensors[tensors.length - 1];
    const { start, end } = this.state;
    Object.assign(this.state, { tensor, step });
    if ((start !== null && step < start) || (end !== null && step > end)) await this.setZoom(null, null);
    else this.applySelection();
    if (tl) {
      tl.element.scrollIntoView({ block: "nearest" });
      tl.canvas.focus({ preventScroll: true });
    }
  }

  /** A clicked cell: the tensor, and the step in its bucket that is worst (first of them). */
  async selectCell(row, col) {
    const tl = this.timeline;
    const tensor = tl.data.rows[row].tensor;
    const start = tl.data.bucket_start[col];
    const end = tl.data.bucket_end[col];
    let step = start;
    if (end > start) {
      try {
        const s = await this.getSeries(this.state.run, tensor, { start, end, maxPoints: 100000 });
        const worst = Math.max(...s.health);
        if (s.steps.length) step = s.steps[s.health.indexOf(worst)];
      } catch {
        // keep the bucket's first step
      }
    }
    Object.assign(this.state, { tensor, step });
    this.applySelection();
  }

  async describe(row, col) {
    const tl = this.timeline;
    const tensor = tl.data.rows[row].tensor;
    const start = tl.data.bucket_start[col];
    const end = tl.data.bucket_end[col];
    const s = await this.getSeries(this.state.run, tensor, { start, end, maxPoints: 1 });
    return describeCell(s, { bucket: end > start, summary: this.summary });
  }

  getSeries(run, tensor, range) {
    const key = JSON.stringify([run, tensor, range.start, range.end, range.maxPoints, this.requestParams()]);
    if (!this.series.has(key)) {
      if (this.series.size > 500) this.series.clear();
      const p = api.series(run, tensor, range, this.requestParams());
      p.catch(() => this.series.delete(key));
      this.series.set(key, p);
    }
    return this.series.get(key);
  }

  /** TensorBoard's colour of a run: its index in TensorBoard's run list (else in ours). */
  colourOf(run) {
    const order = this.tbRuns && this.tbRuns.includes(run) ? this.tbRuns : this.runList.map((r) => r.run);
    return runColour(order.indexOf(run), document.documentElement.dataset.theme === "dark");
  }

  async loadCharts() {
    const gen = ++this.chartGeneration;
    const { run, compare, tensor, start, end, step, log } = this.state;
    const s = this.summary;
    const tl = this.timeline;
    if (!s || !tl || !tl.data || tensor === null) {
      replace(this.selectedName, "Select a tensor in the timeline");
      return this.charts.message("Nothing selected.");
    }
    const info = tl.data.rows[tl.rowOf(tensor)];
    replace(
      this.selectedName,
      el("span", { class: "tensor-name", title: tensor }, tensor),
      info ? ` · ${[info.op_type, info.phase, info.role, info.dtype].filter(Boolean).join(", ")}` : ""
    );
    const range = { start: start ?? undefined, end: end ?? undefined };
    const globalTag = tl.data.rows.find((x) => x.role === "global_norm")?.tensor;
    const seriesOf = (r, t) => (t ? this.getSeries(r, t, range).catch(() => null) : null);
    try {
      const [series, globalSeries, refSeries, refGlobal] = await Promise.all([
        this.getSeries(run, tensor, range),
        seriesOf(run, globalTag),
        compare ? seriesOf(compare, tensor) : null,
        compare ? seriesOf(compare, globalTag) : null,
      ]);
      if (compare) await this.tbRunsAsked;
      if (gen !== this.chartGeneration) return;
      this.charts.set({
        series,
        globalSeries,
        domain: [start ?? s.first_step, end ?? s.last_step],
        anomalyStep: s.first_anomaly ? s.first_anomaly.step : null,
        selectedStep: step,
        log,
        runs: compare ? [{ run, colour: this.colourOf(run) }, { run: compare, colour: this.colourOf(compare), series: refSeries, globalSeries: refGlobal }] : null,
      });
    } catch (e) {
      if (gen === this.chartGeneration) this.charts.message(`Error: ${e.message}`);
    }
  }

  // ------------------------------------------------------------- controls

  setRun(run) {
    Object.assign(this.state, { run, tensor: null, step: null, start: null, end: null });
    if (this.state.compare === run) this.state.compare = null;
    this.compareSelect.set(this.runList, this.state.compare, run);
    this.save();
    this.loadRun();
  }

  setCompare(run) {
    this.state.compare = run;
    this.save();
    this.loadRun();
  }

  setParams(params) {
    this.state.params = params;
    this.invalid = {};
    this.safeForm.set(params);
    this.save();
    this.load();
  }

  async setZoom(start, end) {
    if (start !== null && end !== null && start > end) [start, end] = [end, start];
    if (start !== null && start < 0) start = 0;
    Object.assign(this.state, { start, end });
    this.save();
    this.showZoom(); // at once, with the link: the timeline follows when read
    const gen = ++this.generation;
    this.busy.textContent = "Loading…";
    await this.loadTimeline(gen, Promise.resolve(this.summary));
    if (gen !== this.generation) return;
    this.busy.textContent = "";
    this.applySelection();
  }

  redraw() {
    if (this.timeline) this.timeline.draw();
    this.charts.redraw();
  }
}
