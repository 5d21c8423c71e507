/**
 * @file The spikes card: the gradient norm and the loss at every step, their spike steps marked;
 * hidden where the run holds neither series.
 */

import { logAxis, lineChart } from './chart.js';
import { el } from './dom.js';

export class SpikesCard {
  constructor() {
    this.node = el('div', { class: 'card wide', id: 'spikes' });
  }

  // `spikes`: the `spikes` route's document (null where the run logs no every-step series).
  show(spikes) {
    if (!spikes || (!spikes.grad_norm.steps.length && !spikes.loss.steps.length)) { this.node.style.display = 'none'; return; }
    this.node.style.display = '';
    const width = Math.max(320, Math.floor((this.node.clientWidth || 900) / 2) - 30);
    const chart = (name, line, kind) => el('div', { class: 'chart' }, el('div', { class: 'title' }, `${name} · every step · spike steps marked`),
      lineChart({ ...line, width, height: 160, log: logAxis(line.values, name), marks: spikes.spikes.filter((f) => f.kind === kind).map((f) => f.step), label: name }));
    this.node.replaceChildren(el('h2', {}, 'Spikes', el('span', { class: 'hint' }, `${spikes.spikes.length} spike${spikes.spikes.length === 1 ? '' : 's'}`)),
      el('div', { class: 'charts' },
        spikes.grad_norm.steps.length ? chart('step/grad_norm', spikes.grad_norm, 'gradient_spike') : null,
        spikes.loss.steps.length ? chart('step/loss', spikes.loss, 'loss_spike') : null));
  }
}
