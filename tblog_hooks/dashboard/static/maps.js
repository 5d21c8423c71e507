/**
 * @file The heatmap cards' parts: a heatmap document narrowed to the rows a filter matches and
 * put on a step axis, the card of the run's heatmap (its title, the selection, the downloads, the
 * range hint, the zoom buttons) and the card of the compared run's.
 */

import { el } from './dom.js';
import { fetchJson } from './routes.js';

// The rows of a heatmap document that the regular expression `pattern` matches (all when it is
// empty or `invalid`).
export function filtered(doc, pattern) {
  let re = null;
  try { re = pattern ? new RegExp(pattern) : null; } catch { return { doc, invalid: true }; }
  if (!re) return { doc, invalid: false };
  const keep = doc.modules.map((m, i) => (re.test(m) ? i : -1)).filter((i) => i >= 0);
  return { doc: { ...doc, modules: keep.map((i) => doc.modules[i]), values: keep.map((i) => doc.values[i]) }, invalid: false };
}

// A heatmap document on the columns `steps` (a superset of its own): `null` where it has no value.
export function onSteps(doc, steps) {
  if (steps === doc.steps) return doc;
  const at = new Map(doc.steps.map((s, i) => [s, i]));
  const columns = steps.map((s) => at.get(s));
  return { ...doc, steps, values: doc.values.map((row) => columns.map((c) => (c === undefined ? null : row[c]))) };
}

export class MapCard {
  // The card around `heatmap`, the run's.
  constructor(heatmap) {
    this.title = el('span', { id: 'heatmap-title' });
    this.selection = el('span', { class: 'hint selection', id: 'selection' }, 'click a cell or a finding');
    this.downloads = el('span');
    this.rangeHint = el('span', { class: 'hint', id: 'range-hint' });
    const zoom = el('span', { class: 'zoom' },
      this.rangeHint,
      el('button', { onclick: () => heatmap.zoom(1 / 1.5), title: 'smaller rows' }, '−'),
      el('button', { onclick: () => heatmap.zoom(1.5), title: 'taller rows' }, '+'));
    this.node = el('div', { class: 'card', id: 'heatmap' }, el('h2', {}, this.title, this.selection, this.downloads, zoom), heatmap.node);
  }

  // Say what the map shows: `shown` of the document `doc` of `stat`, on the steps of `range`
  // (null: all), `own` of them the document's; every row where the filter is `invalid`.
  describe({ stat, doc, shown, own, range, invalid }) {
    const rows = shown.modules.length === doc.modules.length ? `${doc.modules.length}` : `${shown.modules.length} of ${doc.modules.length}`;
    const columns = range ? `${own} of ${doc.steps.length} · steps ${range.from} to ${range.to}` : `${doc.steps.length}`;
    this.rangeHint.textContent = range ? 'double-click for all steps' : 'drag across the steps to narrow them';
    this.title.textContent = `${stat} · ${rows} × ${columns}${invalid ? ' · invalid filter: every row shown' : ''}${doc.sampled ? ' · TensorBoard\'s sample of the steps' : ''}`;
  }

  // Name the selection: `module` ('' for the whole model) at `step` (undefined: every step).
  select(module, step) {
    this.selection.textContent = !module ? `step ${step} (whole model)` : step === undefined ? module : `${module} · step ${step}`;
    this.selection.dataset.module = module;
    this.selection.dataset.step = step;
  }

  unselect() {
    this.selection.textContent = 'click a cell or a finding';
    delete this.selection.dataset.module;
    delete this.selection.dataset.step;
  }
}

export class CompareCard {
  // The card around `compare`, the compared run's heatmap; hidden until a run is compared.
  constructor(compare) {
    this.compare = compare;
    this.title = el('span', { id: 'compare-title' });
    this.node = el('div', { class: 'card', id: 'compare-card', style: 'display:none' }, el('h2', {}, this.title), compare.node);
  }

  // Show the run `other` (null: none) beside `page`'s run: `otherShown`, its heatmap document of
  // `stat` on the steps and rows of `shown`, the run's (null where `other` holds no `stat`), on the
  // colour scale `scale` they share, with `other`'s findings; below them, how far apart they are.
  async show(page, other, stat, shown, otherShown, scale) {
    this.node.style.display = other ? '' : 'none';
    if (!other) return;
    this.title.textContent = otherShown ? `${other.name} · ${stat} · same step axis and colour scale` : `${other.name} holds no ${stat}`;
    import('./compare.js').then((m) => m.showDifference(page, otherShown && other, stat, shown, otherShown));
    if (!otherShown) return;
    this.compare.set(otherShown, stat, [], { scale, range: page.range });
    const found = await fetchJson('findings', { run: other.run, prefix: other.prefix }).catch(() => []);
    if (this.compare.doc === otherShown) { this.compare.marks = found; this.compare.draw(); }
  }
}
