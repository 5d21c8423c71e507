/**
 * @file Links from the tab to TensorBoard's own Scalars and Histograms tabs, filtered to a module
 * (or to the whole model's every-step series) and to the run shown.
 */

import { el } from './dom.js';

// TensorBoard's own tab (`scalars`, `histograms`) with its tag filter `filter` and its run filter
// showing the run `run` alone (TensorBoard 2.21's `tagFilter` and `regexInput`: its `runSelectionState`
// in a URL leaves the run list empty). It opens in a browser tab of its own: TensorBoard reads a
// tab's filters from the URL when it first shows that tab, not when only the URL's hash changes.
function chartsUrl(tab, filter, run) {
  let url;
  try { url = new URL(window.parent.location.href); } catch { url = new URL('../../../', import.meta.url); }
  const only = `^${run.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}$`;
  url.hash = `${tab}&tagFilter=${encodeURIComponent(filter)}&regexInput=${encodeURIComponent(only)}`;
  return url.href;
}

// Links to the Scalars and Histograms charts of `name` (a module, or a parameter: its module's;
// Histograms where the run holds some of them), or with '' to the Scalars of the whole model's
// every-step series; null where none is known. `table`: the run's module table (null while it is
// read), `run`: the run's name in TensorBoard.
export function linksToCharts(table, run, name) {
  if (!table) return null;
  const owners = name ? table.rows.filter((r) => name === r.module || name.startsWith(`${r.module}.`)) : [];
  const row = owners.reduce((a, b) => (!a || b.module.length > a.module.length ? b : a), null);
  const filter = name ? row?.tag_filter : table.model_tag_filter;
  if (!filter) return null;
  const link = (tab, text) => el('a', {
    href: chartsUrl(tab, filter, run), target: '_blank', rel: 'noopener', class: 'tb-link', 'data-tab': tab,
    title: `TensorBoard's ${text} tab, filtered to ${name ? (row.module === name ? 'this module' : `${row.module}, this parameter's module`) : 'the whole model\'s series'}`,
    onclick: (event) => event.stopPropagation(),
  }, `${text} ↗`);
  return el('span', { class: 'tb-links' }, link('scalars', 'Scalars'), row?.histograms ? link('histograms', 'Histograms') : null);
}
