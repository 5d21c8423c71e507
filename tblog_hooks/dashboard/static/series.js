/**
 * @file The series card: the selected module's statistics (and its parameters') over the logged
 * steps, a chart each, its findings' steps and the selected step marked.
 */

import { logAxis, lineChart } from './chart.js';
import { el } from './dom.js';
import { downloads, fetchJson } from './routes.js';
import { hideTooltip } from './tooltip.js';

export class SeriesCard {
  constructor() {
    this.box = el('div', { class: 'charts', id: 'series' });
    this.title = el('span', {}, 'Module');
    this.links = el('span', { id: 'series-links' });
    this.downloads = el('span');
    this.node = el('div', { class: 'card' }, el('h2', {}, this.title, this.links, this.downloads), this.box);
  }

  // No module selected.
  clear() {
    this.title.textContent = 'Module';
    this.links.replaceChildren();
    this.downloads.replaceChildren();
    this.box.replaceChildren(el('div', { class: 'empty' }, 'Click a row of the heatmap to see that module\'s statistics.'));
  }

  // The series of `module` in `page`'s model, `step` marked; drawn only while the page still
  // shows that model and has that module selected.
  async show(page, module, step) {
    const model = page.model;
    const doc = await fetchJson('series', page.query({ module }));
    if (page.model !== model || page.selection?.module !== module) return;
    hideTooltip();
    this.title.textContent = `Module ${module}`;
    this.links.replaceChildren(page.chartLinks(module) || '');
    this.downloads.replaceChildren(downloads('series', page.query({ module })));
    const marks = (page.analysis?.findings || []).filter((f) => f.module && (f.module === module || f.module.startsWith(`${module}.`))).map((f) => f.step);
    const width = Math.max(200, Math.floor((this.box.clientWidth - 40) / 2));  // two a row, room for a scrollbar
    const charts = doc.series.map((s) => {
      const title = s.name === module ? s.stat : `${s.stat} · ${s.name.slice(module.length + 1)}`;
      const chart = el('div', { class: 'chart', 'data-stat': s.stat, 'data-name': s.name }, el('div', { class: 'title', title: s.name }, title),
        lineChart({ steps: doc.steps, values: s.values, width, height: 110, log: logAxis(s.values, s.stat), marks, at: step, label: `${s.name} ${s.stat}` }));
      chart.style.width = `${width}px`;
      return chart;
    });
    this.box.replaceChildren(...(charts.length ? charts : [el('div', { class: 'empty' }, 'No statistics for this module.')]));
  }
}
