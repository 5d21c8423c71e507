/**
 * @file The findings card: the run's findings at the steps of the range, each chosen with a click
 * or the keyboard, its value labelled by what the rule compared (the server's `kinds` table).
 */

import { chooseable, el } from './dom.js';
import { format } from './values.js';

const CHOOSE = 'click one (or Enter) to see its cell';

// Whether two findings are the same one (read again, they are other objects).
const sameFinding = (a, b) => !!a && !!b && a.kind === b.kind && a.module === b.module && a.step === b.step;

export class FindingsCard {
  // `kinds`: what each finding kind's `value` is, from the server's table (`label` beside the
  // number, `meaning` the sentence: a vanishing finding's value is a ratio, not the norm in its
  // cell); `onChoose(finding)` when one is chosen; `links(module)`: links to its charts (or null).
  constructor(kinds, { onChoose, links }) {
    this.kinds = kinds;
    this.onChoose = onChoose;
    this.links = links;
    this.rows = [];
    this.box = el('div', { class: 'findings', id: 'findings' });
    this.hint = el('span', { class: 'hint', id: 'findings-hint' }, CHOOSE);
    this.range = el('span', { class: 'hint', id: 'findings-range' });
    this.downloads = el('span');
    this.node = el('div', { class: 'card' }, el('h2', {}, 'Findings', this.range, this.hint, this.downloads), this.box);
  }

  measureOf(kind) {
    return this.kinds[kind] || { label: '', meaning: 'the quantity the rule compared: see the message' };
  }

  // While the run is read: no findings yet.
  reading(placeholder) {
    this.box.replaceChildren(placeholder);
    this.downloads.replaceChildren();
    this.rows = [];
  }

  // Say whether the findings were judged on TensorBoard's sample (`table`: the module table).
  showSampling(table) {
    this.hint.textContent = table?.sampled ? `judged on TensorBoard's sample of ${table.logged_steps.toLocaleString()} logged steps · ${CHOOSE}` : CHOOSE;
  }

  // `findings`: those of the run's `total` at the steps of `range` (null: all steps); `selected` marked.
  show(findings, total, range, selected) {
    this.range.textContent = range ? `${findings.length} of ${total} in steps ${range.from} to ${range.to}` : '';
    if (!findings.length) {
      const none = range && total ? `No findings in steps ${range.from} to ${range.to}.` : 'No findings: every rule stayed quiet.';
      this.box.replaceChildren(el('div', { class: 'empty' }, none));
      this.rows = [];
      return;
    }
    const body = el('tbody');
    this.rows = findings.map((f) => {
      const row = chooseable(el('tr', { 'data-module': f.module, 'data-step': f.step, onclick: () => this.onChoose(f) },
        el('td', {}, el('span', { class: `kind ${f.kind}` }, f.kind)),
        el('td', { class: 'num' }, String(f.step)),
        el('td', { class: 'module' }, f.module || '(model)', this.links(f.module)),
        el('td', { class: 'num value', title: this.measureOf(f.kind).meaning }, format(f.value), el('span', { class: 'unit' }, this.measureOf(f.kind).label)),
        el('td', { class: 'message' }, f.message)));
      row.finding = f;
      body.append(row);
      return row;
    });
    this.mark(selected);
    this.box.replaceChildren(el('table', {},
      el('thead', {}, el('tr', {}, ...['kind', 'step', 'module', 'value', 'message'].map((h) => el('th', {
        class: h === 'step' || h === 'value' ? 'num' : '',
        title: h === 'value' ? 'what the rule compared, which differs by kind (under each value; hover it for the sentence)' : '',
      }, h)))), body));
  }

  // Mark the row of `finding` (none without one).
  mark(finding) {
    for (const row of this.rows) row.classList.toggle('selected', sameFinding(row.finding, finding));
  }
}
