/**
 * @file The toolbar: the Run, Statistic and Compare with lists, the module filter, Reload, the
 * run's summary and whether the tab follows TensorBoard's reloads; under it, where what the tab
 * shows is TensorBoard's sample of the steps.
 */

import { el } from './dom.js';

// Say whether the tab follows the runs as they are written: it reads them again on each of
// TensorBoard's reloads, which come on their own only with its auto-reload on (`host` tells, and
// says when the user changes it).
export function followHint(host) {
  const node = el('span', { class: 'hint', id: 'follow' });
  const show = () => {
    const { on, periodMs } = host.autoReload();
    node.dataset.on = String(on);
    node.textContent = on
      ? `Following the runs: TensorBoard's auto-reload reads them every ${Math.round(periodMs / 1000)} s.`
      : 'TensorBoard\'s auto-reload is off: its reload button (⟳) reads the runs again; turn on "Reload data" in its settings (⚙) to follow a training as it runs.';
  };
  show();
  host.onSettings(show);
  return node;
}

export class Toolbar {
  // The lists and the filter act on `page`; `follow`: the hint of `followHint`.
  constructor(page, follow) {
    const redraw = () => { page.drawHeatmap(); page.keep(); };
    this.runSelect = el('select', { id: 'run', onchange: () => page.open(page.models[this.runSelect.value]) });
    this.statSelect = el('select', { id: 'stat', onchange: redraw });
    this.compareSelect = el('select', { id: 'compare', onchange: redraw });
    this.filter = el('input', { id: 'filter', type: 'search', placeholder: 'filter modules (regex)', value: page.state.filter || '', oninput: redraw });
    this.summary = el('span', { class: 'summary', id: 'summary' });
    this.sampling = el('div', { class: 'hint sampling', id: 'sampling', style: 'display:none' });
    this.node = el('div', { class: 'toolbar' },
      el('label', {}, 'Run', this.runSelect),
      el('label', {}, 'Statistic', this.statSelect),
      el('label', {}, 'Compare with', this.compareSelect),
      el('label', {}, this.filter),
      el('button', { onclick: () => page.reload(true), title: 'read the run again' }, 'Reload'),
      this.summary,
      follow);
  }

  // Fill the Run and Compare lists from `models`, showing the runs named `shown` and `compare`.
  list(models, shown, compare) {
    this.runSelect.replaceChildren(...models.map((m, i) => el('option', { value: i }, m.name)));
    this.compareSelect.replaceChildren(el('option', { value: '' }, '—'), ...models.map((m, i) => el('option', { value: i }, m.name)));
    const index = (name) => models.findIndex((m) => m.name === name);
    if (index(shown) >= 0) this.runSelect.value = String(index(shown));
    this.compareSelect.value = index(compare) >= 0 ? String(index(compare)) : '';
  }

  // The run of `models` chosen to compare with (null for none).
  compareModel(models) {
    return this.compareSelect.value === '' ? null : models[this.compareSelect.value];
  }

  // Show `model` (one of `models`) in the Run list and its statistics in the Statistic list, `stat` chosen where it has it.
  showModel(models, model, stat) {
    this.runSelect.value = String(models.indexOf(model));
    this.statSelect.replaceChildren(...model.stats.map((s) => el('option', { value: s }, s)));
    if (model.stats.includes(stat)) this.statSelect.value = stat;
  }

  // The filter's regular expression: marked when it is not one (and then every row is shown).
  markFilter(invalid) {
    this.filter.classList.toggle('invalid', invalid);
    this.filter.title = invalid ? 'not a regular expression: every row is shown' : '';
  }

  // Say where TensorBoard's sample is what the page shows (it keeps 1,000 values of a scalar tag by
  // default): `doc` the heatmap's document, `table` the module table (null while it is read).
  showSampling(doc, table) {
    const parts = [];
    if (doc?.sampled || table?.sampled) {
      const steps = doc.steps;
      parts.push(`TensorBoard kept a sample of ${(table?.logged_steps ?? steps.length).toLocaleString()} of this run's logged steps (steps ${steps[0]} to ${steps[steps.length - 1]}, more were written): the heatmap shows them and the findings are judged on them.`);
    }
    this.sampling.style.display = parts.length ? '' : 'none';
    this.sampling.textContent = parts.length ? `${parts.join(' ')} tblog-hooks report reads every value; or start TensorBoard with --samples_per_plugin scalars=100000,tblog_hooks=100000.` : '';
  }
}
