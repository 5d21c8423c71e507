/**
 * @file The difference view of *Compare with*: the chosen statistic of two runs as one heatmap
 * coloured by how far apart they are, where they part (the `compare` route, `tblog-hooks compare
 * --json`) outlined and named above it, each module's first differing step marked on its row.
 * page.js imports this module when a run is compared.
 */

import { el, escapeHtml } from './dom.js';
import { Heatmap } from './heatmap.js';
import { legend } from './legend.js';
import { fetchJson } from './routes.js';
import { Scale } from './scales.js';
import { showTooltip, tooltip } from './tooltip.js';
import { format } from './values.js';

const FIRST_RGB = '#00b8d4';  // the outline of where the runs part: apart from the red marks and viridis

// How far apart two values are: |log10(b / a)| where they have one sign, the relative difference
// |a - b| / max(|a|, |b|) where signs differ (or one is 0); Infinity (drawn as non-finite) where
// one is finite and the other not; null where either has no value.
export function difference(a, b) {
  if (a === null || a === undefined || b === null || b === undefined) return null;
  if (typeof a === 'string' || typeof b === 'string') return a === b ? 0 : Infinity;  // "NaN", "Infinity"
  if (a === b) return 0;
  if (a * b > 0) return Math.abs(Math.log10(b / a));
  return Math.abs(a - b) / Math.max(Math.abs(a), Math.abs(b));
}

// The heatmap of the differences: hover shows both runs' values, the first divergence is outlined.
class DifferenceMap extends Heatmap {
  // `pair`: {a, b, names}: each run's values on the same rows and columns, and the runs' names;
  // `range`: the steps the page narrowed the heatmaps to (null: all).
  show(doc, pair, marks, first, range) {
    this.pair = pair;
    this.first = first;
    this.set(doc, 'difference', marks, { scale: new Scale(doc.values, 'log'), range });  // log10 over the values, zeros grey
    this.legendBox.replaceChildren(legend(this.scale, false), el('div', { class: 'legend' },
      el('span', { class: 'swatch' }, el('i', { style: 'border:2px solid #ff1744;background:none' }), 'a module\'s first difference'),
      el('span', { class: 'swatch' }, el('i', { style: `border:2px solid ${FIRST_RGB};background:none` }), 'where the runs part')));
  }

  pointer(event) {
    const cell = this.cellAt(event);
    if (!cell) { super.pointer(event); return; }
    this.hover = cell;
    const [a, b] = [this.pair.a[cell.row][cell.col], this.pair.b[cell.row][cell.col]];
    const value = this.doc.values[cell.row][cell.col];
    const [nameA, nameB] = this.pair.names;
    const html = `<b>${escapeHtml(this.doc.modules[cell.row])}</b><br>step ${this.doc.steps[cell.col]}`
      + `<br>${escapeHtml(nameA)}: ${escapeHtml(format(a))}<br>${escapeHtml(nameB)}: ${escapeHtml(format(b))}`
      + `<br>difference ${escapeHtml(format(value))}`;
    showTooltip(event, html, value === null ? '' : value);
    tooltip.dataset.a = a === null ? '' : String(a);
    tooltip.dataset.b = b === null ? '' : String(b);
    this.draw();
  }

  draw() {
    super.draw();
    const row = this.first && this.rowOf.get(this.first.module);
    if (row === undefined || row === null || !this.shows(this.first.step)) return;
    const y = row * this.rowHeight - this.scroller.scrollTop;
    if (y + this.rowHeight < 0 || y >= this.plotHeight) return;
    const ctx = this.canvas.getContext('2d');
    ctx.strokeStyle = FIRST_RGB;
    ctx.lineWidth = 2.5;
    const x = this.left + this.column(this.first.step) * this.colWidth;
    ctx.strokeRect(x - 1.5, y - 1.5, Math.max(2, this.colWidth) + 3, Math.max(2, this.rowHeight) + 3);
  }

  // Where the first divergence's cell is, in the canvas's CSS pixels (the browser tests hover there).
  firstCentre() {
    return this.centre(this.first.module, this.doc.steps[this.column(this.first.step)]);
  }
}

// The card's part below the side-by-side heatmaps: a title naming where the runs part, the map.
class DifferenceView {
  constructor(page) {
    this.page = page;
    this.title = el('span', { id: 'difference-title' });
    this.map = new DifferenceMap({
      height: 400, onSelect: (module, step) => page.select(module, step), onRange: (from, to) => page.narrow(from, to),
    });
    this.node = el('div', { id: 'difference' },
      el('h2', {}, 'Difference', el('span', { class: 'hint' }, '|log10(b / a)|, the relative difference where signs differ')),
      el('div', { class: 'hint', id: 'difference-first' }, this.title), this.map.node);
    this.documents = new Map();  // the compare documents read, by query
    this.latest = 0;  // the number of the latest show(): an earlier one that ends later draws nothing
  }

  async show(other, stat, doc, otherDoc) {
    const model = this.page.model;
    const query = { run: model.run, prefix: model.prefix, other: other.run, other_prefix: other.prefix };
    const key = JSON.stringify([query, model.max_step, other.max_step]);
    if (!this.documents.has(key)) this.documents.set(key, fetchJson('compare', query));
    const call = ++this.latest;
    const compared = await this.documents.get(key);
    if (call !== this.latest) return;
    this.compared = compared;
    const [rows, steps] = [doc.modules.filter((m) => otherDoc.modules.includes(m)), doc.steps.filter((s) => otherDoc.steps.includes(s))];
    const pick = (d) => {
      const [row, col] = [new Map(d.modules.map((m, i) => [m, i])), new Map(d.steps.map((s, j) => [s, j]))];
      return rows.map((m) => steps.map((s) => d.values[row.get(m)][col.get(s)]));
    };
    const [a, b] = [pick(doc), pick(otherDoc)];
    const values = a.map((row, i) => row.map((v, j) => difference(v, b[i][j])));
    const marks = compared.modules.map((m) => ({ module: m.module, step: m.step, kind: `first difference: ${m.stat}` }));
    this.map.show({ ...doc, modules: rows, steps, values }, { a, b, names: [compared.a, compared.b] }, marks, compared.first, this.page.range);
    this.title.textContent = describe(compared, stat);
    Object.assign(this.title.dataset, compared.first ? { module: compared.first.module, step: compared.first.step } : { module: '', step: '' });
  }
}

function describe(compared, stat) {
  const { first } = compared;
  const series = Object.entries(compared.per_step).filter(([, d]) => d).map(([name, d]) => `step/${name} first differs at step ${d.step}`);
  if (!first) return [compared.diverged ? 'the logged statistics agree' : 'every common value agrees', ...series].join(' · ');
  return [`they part at step ${first.step} in ${first.module}: ${first.stat} ${format(first.a)} against ${format(first.b)}`
    + ` (relative difference ${format(first.rel)})${first.stat.startsWith(`${stat}/`) ? '' : `; shown: ${stat}`}`, ...series].join(' · ');
}

const views = new WeakMap();

// The hook page.js calls when *Compare with* shows `other`'s heatmap of `stat` under the run's
// (both documents as drawn, the filter applied); without `other`, the view is hidden.
export async function showDifference(page, other, stat, doc, otherDoc) {
  let view = views.get(page);
  if (!view) {
    view = new DifferenceView(page);
    views.set(page, view);
    page.compareCard.node.append(view.node);
    page.difference = view;  // for scripts and the browser tests
  }
  view.node.style.display = other ? '' : 'none';
  if (!other) return;
  try {
    await view.show(other, stat, doc, otherDoc);
    view.map.node.style.display = '';
  } catch (error) {
    view.title.textContent = String(error.message || error);  // the runs cannot be compared (no common step)
    view.map.node.style.display = 'none';
  }
}
