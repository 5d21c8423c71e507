/**
 * @file The legend under a map: its scale's colour bar with ticks, and the swatches of zero,
 * non-finite and missing cells and of a finding's outline.
 */

import { LABEL_FONT, el, svg, textWidth } from './dom.js';
import { NONE_RGB, NONFINITE_RGB, VIRIDIS, ZERO_RGB } from './scales.js';

let gradients = 0;  // the legends' colour bars, each a gradient with an id of its own

// The colour bar of a scale with its ticks and their labels, as SVG. A label stays whole inside
// the bar's width: centred on its tick where it fits, else moved in from the edge; a label that
// would cover another is left out (the ends first, then the ticks in order).
function colourBar(scale) {
  const [width, left, right] = [260, 10, 250];
  const id = `viridis-${++gradients}`;
  const stops = VIRIDIS.map((rgb, i) => svg('stop', { offset: i / (VIRIDIS.length - 1), 'stop-color': `rgb(${rgb.join(',')})` }));
  const bar = svg('svg', { width, height: 30, viewBox: `0 0 ${width} 30`, role: 'img' },
    svg('defs', {}, svg('linearGradient', { id }, ...stops)),
    svg('rect', { x: left, y: 0, width: right - left, height: 12, fill: `url(#${id})` }));
  const ticks = scale.ticks().map(([t, label]) => {
    const x = left + t * (right - left);
    const half = textWidth(label) / 2 + 1;
    const centre = Math.min(width - half, Math.max(half, x));
    return { t, x, label, from: centre - half, to: centre + half, centre };
  });
  const rank = (tick) => (tick.t === 0 || tick.t === 1 ? 0 : 1);  // the ends first
  const shown = [];
  for (const tick of [...ticks].sort((a, b) => rank(a) - rank(b))) {
    if (!shown.some((s) => tick.from < s.to + 4 && s.from < tick.to + 4)) shown.push(tick);
  }
  for (const tick of ticks) bar.append(svg('rect', { x: tick.x - 0.5, y: 12, width: 1, height: 3, fill: '#616161' }));
  for (const tick of shown.sort((a, b) => a.t - b.t)) {
    bar.append(svg('text', { x: tick.centre, y: 26, 'text-anchor': 'middle', fill: '#616161', style: `font: ${LABEL_FONT}` }, tick.label));
  }
  return bar;
}

export function legend(scale, findings = true) {
  const swatch = (rgb, text) => {
    const box = el('i');
    box.style.background = `rgb(${rgb.join(',')})`;
    return el('span', { class: 'swatch' }, box, text);
  };
  return el(
    'div',
    { class: 'legend' },
    colourBar(scale),
    el('span', { class: 'scale-name' }, scale.log ? 'log scale' : 'linear scale'),
    scale.log ? swatch(ZERO_RGB, '0') : null,
    swatch(NONFINITE_RGB, 'NaN/Inf'),
    swatch(NONE_RGB, 'no value'),
    findings ? el('span', { class: 'swatch' }, el('i', { style: 'border:2px solid #ff1744;background:none' }), 'finding') : null,
  );
}
