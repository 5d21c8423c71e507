/**
 * @file The page: which run is shown, its analysis, the selection and the range of steps, kept in
 * TensorBoard's URL; it lays out the cards, opens a run, and draws them again on a reload.
 */

import { AttentionCard } from './attention.js';
import { el } from './dom.js';
import { FindingsCard } from './findings.js';
import { Heatmap } from './heatmap.js';
import { linksToCharts } from './links.js';
import { CompareCard, MapCard, filtered, onSteps } from './maps.js';
import { ModuleTable } from './modules.js';
import { OverviewCard } from './overview.js';
import { downloads, fetchJson, requests } from './routes.js';
import { Scale, scaleOf, useScales } from './scales.js';
import { SeriesCard } from './series.js';
import { SpikesCard } from './spikes.js';
import { TableCard } from './tables.js';
import { Toolbar, followHint } from './toolbar.js';
import { hideTooltip, tooltip } from './tooltip.js';

// Whether two runs' descriptions are of one run: TensorBoard's reloads (its auto-reload among them, at
// any moment) list the runs anew, so a run is known by its name, not by the object describing it.
const sameRun = (a, b) => a?.name === b?.name;

export class Page {
  // `root`: the element the page fills; `host`: TensorBoard's page around it (host.js).
  constructor(root, host) {
    this.root = root;
    this.host = host;
    this.models = [];
    this.model = null;
    this.analysis = null;
    this.selection = null;
    this.queue = Promise.resolve();
    this.requests = requests;  // what is in flight
  }

  async start() {
    const [models, scales, kinds, state] = await Promise.all([fetchJson('runs'), fetchJson('scales'), fetchJson('kinds'), this.host.state()]);
    useScales(scales);
    this.kinds = kinds;
    this.state = state;
    const reload = () => this.reload(false).catch(() => {});  // the server may be gone
    this.host.listen('experimental.DataReloaded', reload);
    this.host.listen('experimental.RunsChanged', reload);
    this.follow = followHint(this.host);
    this.models = models;
    if (!models.length) {
      this.root.replaceChildren(el('div', { class: 'card empty', id: 'no-runs' }, 'No run holds tblog_hooks tags yet. ', this.follow));
      return;
    }
    await this.build();
  }

  async build() {
    const narrow = (from, to) => this.narrow(from, to);
    const links = (name) => this.chartLinks(name);
    this.compare = new Heatmap({ height: 400, onRange: narrow });
    this.compareCard = new CompareCard(this.compare);
    this.toolbar = new Toolbar(this, this.follow);
    this.heatmap = new Heatmap({ onSelect: (module, step) => this.select(module, step), onRange: narrow });
    this.mapCard = new MapCard(this.heatmap);
    this.findingsCard = new FindingsCard(this.kinds, { onChoose: (f) => this.select(f.module, f.step, f), links });
    this.seriesCard = new SeriesCard();
    this.spikesCard = new SpikesCard();
    this.attentionCard = new AttentionCard();
    this.tables = {
      heads: new TableCard('heads', 'Attention per head', 'each attention module\'s heads at one logged step'),
      numerics: new TableCard('numerics', 'Low precision per format', 'the fraction of each watched module\'s outputs and output gradients each format would lose, at one logged step'),
    };
    this.moduleTable = new ModuleTable({ onChoose: (module) => this.select(module, undefined), links });
    this.overviewCard = new OverviewCard((name) => this.openNamed(name));
    this.root.replaceChildren(
      this.toolbar.node,
      this.toolbar.sampling,
      this.overviewCard.node,
      el('div', { class: 'grid' },
        el('div', {}, this.mapCard.node, this.compareCard.node),
        el('div', {}, this.findingsCard.node, this.seriesCard.node)),
      this.spikesCard.node,
      this.attentionCard.node,
      this.tables.heads.node,
      this.tables.numerics.node,
      this.moduleTable.node,
      tooltip);
    this.listModels(this.models, this.state.compare);
    const first = this.models.find((m) => m.name === this.state.run) || this.models[0];
    const step = this.state.step === undefined ? undefined : Number(this.state.step);
    this.selection = this.state.module !== undefined || step !== undefined ? { module: this.state.module || '', step } : null;
    const [from, to] = [this.state.from, this.state.to].map((v) => (v === undefined || v === '' ? NaN : Number(v)));
    this.range = from <= to ? { from, to } : null;  // (NaN: no range)
    this.wantedStat = this.state.stat;
    await this.open(first, false, true);
    await this.overviewCard.show(this.models, this.model?.name);
  }

  // Open the run (or prefix) named `name`, as choosing it in the Run list does.
  async openNamed(name) {
    const model = this.models.find((m) => m.name === name);
    if (model && !sameRun(model, this.model)) await this.open(model);
  }

  // Fill the Run and Compare lists from `models`, keeping what they show (or showing `compare`).
  listModels(models, compare = this.compareModel()?.name) {
    this.models = models;
    this.toolbar.list(models, this.model?.name, compare);
  }

  compareModel() {
    return this.toolbar.compareModel(this.models);
  }

  // The tab's state, in TensorBoard's URL.
  keep() {
    const stat = this.toolbar.statSelect.value;
    const selection = this.selection || {};
    this.host.keep({
      run: this.model?.name, stat, compare: this.compareModel()?.name, module: selection.module, step: selection.step,
      filter: this.toolbar.filter.value, from: this.range?.from, to: this.range?.to,
    });
  }

  // Narrow the heatmaps and the findings to the steps from `from` to `to` (`null`: all steps).
  narrow(from, to) {
    this.range = from === null ? null : { from, to };
    this.keep();
    if (this.analysis) this.drawFindings();
    return this.drawHeatmap(true);
  }

  inRange(step) {
    return !this.range || (step >= this.range.from && step <= this.range.to);
  }

  query(extra = {}) {
    return { run: this.model.run, prefix: this.model.prefix, ...extra };
  }

  // When TensorBoard reloads (its reload button, its auto-reload), read the runs again: new runs join
  // the lists, and the run shown is read again if it grew (always with `always`, the tab's Reload):
  // all of it where that took the server under 3 s, else the heatmap and the tables only (the
  // findings of a large run are read again on Reload). One reload at a time.
  reload(always) {
    this.queue = this.queue.then(() => this.reloadNow(always));
    return this.queue;
  }

  async reloadNow(always) {
    const models = await fetchJson('runs');
    if (!this.toolbar) {  // the page waits for a first run
      this.models = models;
      if (models.length) await this.build();
      return;
    }
    this.listModels(models);
    await this.overviewCard.show(models, this.model.name).catch(() => {});
    const now = models.find((m) => m.name === this.model.name);
    if (!now || (!always && now.max_step === this.model.max_step)) return;
    const step = this.model.max_step;
    if (always || this.openTook < 3000) {
      await this.open(now, true);
      return;
    }
    this.model = now;
    await Promise.all([this.drawHeatmap(true), ...Object.values(this.tables).map((card) => card.show(this, true))]);
    const { summary } = this.toolbar;
    summary.textContent = `${summary.textContent.split(' · findings as of')[0]} · findings as of step ${step}: Reload to update`;
  }

  // Show `model`: with `keep`, as it was (a reload: new steps join at the right, and the selection,
  // the rows' height, the scroll and the sort stay); else keeping the statistic and the selection
  // where the run has them. `restore`: the state from the URL (its selection is the run's own).
  async open(model, keep = false, restore = false) {
    hideTooltip();
    this.opening = model;  // until it is all drawn (the browser tests wait for it)
    const started = performance.now();
    const stat = this.wantedStat ?? this.toolbar.statSelect.value;
    this.wantedStat = undefined;
    const selection = this.selection;
    const other = !sameRun(model, this.model) && !restore;
    this.model = model;
    this.toolbar.showModel(this.models, model, stat);
    this.overviewCard.mark(model.name);
    this.analysis = null;
    if (!keep) {
      this.heatmap.marks = [];
      const reading = () => el('div', { class: 'empty' }, 'Reading the whole run…');
      this.findingsCard.reading(reading());
      this.moduleTable.reading(reading());
    }
    await this.drawHeatmap(keep);  // first: the rest reads the whole run, which takes the server longer
    // A selection belongs to its run: it stays where this run has its module (or it is about the whole model).
    const held = selection && (!selection.module || this.holds(selection.module));
    this.selection = held ? selection : null;
    if (!held || other) {
      this.mapCard.unselect();
      this.heatmap.select(null, undefined);
      this.seriesCard.clear();
    }
    this.keep();
    const [findings, table, spikes] = await Promise.all([
      fetchJson('findings', this.query()), fetchJson('modules', this.query()), model.spikes ? fetchJson('spikes', this.query()) : null]);
    if (this.model !== model) return;
    this.analysis = { findings, table, spikes };
    this.findingsCard.downloads.replaceChildren(downloads('findings', this.query()));
    this.heatmap.marks = findings;
    this.heatmap.draw();
    this.toolbar.summary.textContent = `${table.rows.length} modules · ${findings.length} finding${findings.length === 1 ? '' : 's'}`;
    this.showSampling();
    this.drawFindings();
    this.moduleTable.show(table);
    this.spikesCard.show(spikes);
    await Promise.all([this.attentionCard.show(this), ...Object.values(this.tables).map((card) => card.show(this, keep))]);
    if (this.selection) await this.select(this.selection.module, this.selection.step, this.selection.finding, !keep);
    this.openTook = performance.now() - started;
    if (this.opening === model) this.opening = null;
  }

  // Links to TensorBoard's charts of `name` in the run shown (links.js).
  chartLinks(name) {
    return linksToCharts(this.analysis?.table, this.model.run, name);
  }

  // Whether the run shown has a module (or parameter) of that name.
  holds(module) {
    const names = this.doc?.modules || [];
    return names.includes(module) || names.some((m) => module.startsWith(`${m}.`) || m.startsWith(`${module}.`));
  }

  // Say where TensorBoard's sample is what the page shows.
  showSampling() {
    const table = this.analysis?.table;
    this.toolbar.showSampling(this.doc, table);
    this.findingsCard.showSampling(table);
  }

  // The chosen statistic's heatmap (and the compared run's beside it) on the steps of the range;
  // `keep`: the same view drawn again (a reload, a new range), which does not scroll the selected
  // row into view.
  async drawHeatmap(keep = false) {
    const model = this.model;
    const stat = this.toolbar.statSelect.value;
    if (!stat) { this.mapCard.title.textContent = 'No per-module statistics in this run'; return; }
    const other = this.compareModel();
    const compared = other && !sameRun(other, model) && other.stats.includes(stat);
    const [doc, otherDoc] = await Promise.all([
      fetchJson('heatmap', this.query({ tag: stat })),
      compared ? fetchJson('heatmap', { run: other.run, prefix: other.prefix, tag: stat }) : null]);
    if (this.model !== model || this.toolbar.statSelect.value !== stat || !sameRun(this.compareModel(), other)) return;
    this.doc = doc;
    this.mapCard.downloads.replaceChildren(downloads('heatmap', this.query({ tag: stat })));
    const pattern = this.toolbar.filter.value.trim();
    const { doc: filteredDoc, invalid } = filtered(doc, pattern);
    this.toolbar.markFilter(invalid);
    // Side by side, both heatmaps share one step axis and one colour scale, so that a column is one
    // step and a colour one value in both.
    const every = otherDoc ? [...new Set([...doc.steps, ...otherDoc.steps])].sort((a, b) => a - b) : doc.steps;
    const steps = this.range ? every.filter((s) => this.inRange(s)) : every;
    const shown = onSteps(filteredDoc, steps);
    const otherShown = otherDoc && onSteps(filtered(otherDoc, pattern).doc, steps);
    const own = doc.steps.filter((s) => this.inRange(s)).length;
    this.mapCard.describe({ stat, doc, shown, own, range: this.range, invalid });
    const scale = otherShown ? new Scale([...shown.values, ...otherShown.values], scaleOf(stat)) : null;
    this.heatmap.set(shown, stat, this.analysis ? this.analysis.findings : [], { scale, range: this.range });
    if (this.selection) this.heatmap.select(this.selection.module, this.selection.step, !keep);
    if (this.analysis) this.showSampling();
    await this.compareCard.show(this, sameRun(other, model) ? null : other, stat, shown, otherShown, scale);
  }

  // The findings at the steps of the range (all without one), the one selected marked.
  drawFindings() {
    const all = this.analysis.findings;
    this.findingsCard.show(all.filter((f) => this.inRange(f.step)), all.length, this.range, this.selection?.finding);
  }

  // Select `module` at `step` (from `finding`, when one was chosen); `reveal`: scroll its row of
  // the heatmap into view (a reload leaves the scroll as it is).
  async select(module, step, finding = undefined, reveal = true) {
    this.selection = { module, step, finding };
    this.mapCard.select(module, step);
    this.findingsCard.mark(finding);
    this.moduleTable.mark(module);
    this.heatmap.select(module, step, reveal);
    this.keep();
    if (module) await this.seriesCard.show(this, module, step);
  }
}
