/**
 * @file The runs overview card: with several runs (or prefixes), each one's findings counted by
 * kind, the worst run first; a run opened with a click or the keyboard.
 */

import { chooseable, el } from './dom.js';
import { fetchJson } from './routes.js';

export class OverviewCard {
  // `onOpen(name)` when a run's row is chosen.
  constructor(onOpen) {
    this.onOpen = onOpen;
    this.rows = [];
    this.version = undefined;
    this.box = el('div', { class: 'overview' });
    this.node = el('div', { class: 'card', id: 'overview', style: 'display:none' },
      el('h2', {}, 'Runs', el('span', { class: 'hint' }, 'findings per run, worst first; click one (or Enter) to open it')), this.box);
  }

  // The overview of `models` (the server judges every run for it, once per change of each), the
  // run named `shown` marked; read again only when a run joined or grew (TensorBoard's reloads
  // come every 30 s). Hidden with fewer than two runs.
  async show(models, shown) {
    if (models.length < 2) { this.node.style.display = 'none'; return; }
    const version = models.map((m) => `${m.name}@${m.max_step}`).join('\n');
    if (version === this.version) return;
    const rows = await fetchJson('overview');
    this.version = version;
    this.node.style.display = '';
    // A run the server could not judge says why in its row; the others' rows are whole.
    this.rows = rows.map((r) => chooseable(el('tr', { 'data-name': r.name, onclick: () => this.onOpen(r.name) },
      el('td', {}, r.name),
      ...(r.error ? [el('td', { class: 'message bad', colspan: 4 }, `could not be judged: ${r.error}`)] : [
        el('td', { class: 'num' }, String(r.findings)),
        el('td', {}, r.worst ? el('span', { class: `kind ${r.worst}` }, r.worst) : 'healthy'),
        el('td', {}, ...Object.entries(r.kinds).map(([kind, n]) => el('span', { class: 'count' }, el('span', { class: `kind ${kind}` }, kind), ` ${n}`))),
        el('td', { class: 'num' }, `${r.logged_steps.toLocaleString()}${r.sampled ? ' (sample)' : ''}`)]))));
    this.box.replaceChildren(el('table', {},
      el('thead', {}, el('tr', {}, ...['run', 'findings', 'worst', 'by kind', 'logged steps'].map((h) => el('th', { class: h === 'findings' || h === 'logged steps' ? 'num' : '' }, h)))),
      el('tbody', {}, ...this.rows)));
    this.mark(shown);
  }

  // Mark the row of the run named `name`.
  mark(name) {
    for (const row of this.rows) row.classList.toggle('selected', row.dataset.name === name);
  }
}
