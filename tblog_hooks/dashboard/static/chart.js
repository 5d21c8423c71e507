/**
 * @file The line chart: one series over the steps on a canvas, its non-finite steps marked in red,
 * with vertical marks (spikes, the selected step), hover and an optional log y axis.
 */

import { el, escapeHtml } from './dom.js';
import { NONFINITE_RGB, scaleOf } from './scales.js';
import { hideTooltip, showTooltip } from './tooltip.js';
import { distinct, finite, format, isValue } from './values.js';

// Whether a series of the statistic `stat` is drawn on a log axis: the statistic's scale is log,
// and the series' finite values are all above 0 (and there is one).
export const logAxis = (values, stat) => scaleOf(stat) === 'log' && values.some(finite) && values.every((v) => !finite(v) || v > 0);

// A line over steps on a canvas, with hover, vertical marks (spikes, the selected step) and an
// optional log y axis.
export function lineChart({ steps, values, width = 300, height = 130, log = false, marks = [], at = undefined, label = '' }) {
  const canvas = el('canvas');
  const dpr = devicePixelRatio;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext('2d');
  const pad = { l: 46, r: 8, t: 6, b: 18 };
  const drawn = (v) => finite(v) && (!log || v > 0);
  // Every step with a value: those drawn on the line, and the non-finite ones, marked in red as on the heatmap.
  const held = steps.map((s, i) => [s, values[i]]).filter(([, v]) => isValue(v));
  const points = held.filter(([, v]) => drawn(v));
  const bad = held.filter(([, v]) => !finite(v)).map(([s]) => s);
  const ys = points.map(([, v]) => (log ? Math.log10(v) : v));
  let [lo, hi] = [Math.min(...ys), Math.max(...ys)];
  if (!points.length) [lo, hi] = [0, 1];
  if (hi - lo < 1e-12) { lo -= 0.5; hi += 0.5; }
  const [s0, s1] = steps.length ? [steps[0], Math.max(steps[0] + 1, steps[steps.length - 1])] : [0, 1];
  const X = (s) => pad.l + ((s - s0) / (s1 - s0)) * (width - pad.l - pad.r);
  const Y = (y) => pad.t + (1 - (y - lo) / (hi - lo)) * (height - pad.t - pad.b);
  const yOf = (v) => Y(log ? Math.log10(v) : v);
  canvas.xOf = X;  // for the browser tests: where a step is drawn
  const draw = (hover) => {
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = '10px Roboto, Arial, sans-serif';
    ctx.fillStyle = '#757575';
    ctx.strokeStyle = '#eeeeee';
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    for (const [t, text] of distinct([0, 0.5, 1], (t) => (log ? 10 ** (lo + t * (hi - lo)) : lo + t * (hi - lo)))) {
      const y = lo + t * (hi - lo);
      ctx.beginPath(); ctx.moveTo(pad.l, Y(y)); ctx.lineTo(width - pad.r, Y(y)); ctx.stroke();
      ctx.fillText(text, pad.l - 4, Y(y));
    }
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    ctx.fillText(String(s0), X(s0), height - pad.b + 4);
    ctx.fillText(String(steps[steps.length - 1] ?? ''), X(s1), height - pad.b + 4);
    for (const s of marks) {
      ctx.fillStyle = 'rgba(255, 23, 68, 0.55)';
      ctx.fillRect(X(s) - 0.75, pad.t, 1.5, height - pad.t - pad.b);
    }
    for (const s of bad) {
      ctx.fillStyle = `rgba(${NONFINITE_RGB.join(',')}, 0.18)`;
      ctx.fillRect(X(s) - 2, pad.t, 4, height - pad.t - pad.b);
      ctx.fillStyle = `rgb(${NONFINITE_RGB.join(',')})`;
      ctx.fillRect(X(s) - 2.5, pad.t, 5, 5);
    }
    if (at !== undefined) { ctx.fillStyle = '#e65100'; ctx.fillRect(X(at) - 0.5, pad.t, 1, height - pad.t - pad.b); }
    ctx.strokeStyle = '#f57c00';
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let joined = false;  // the line breaks at a step that is not drawn (NaN/Inf, or <= 0 on a log axis)
    for (const [s, v] of held) {
      if (!drawn(v)) { joined = false; continue; }
      if (joined) ctx.lineTo(X(s), yOf(v)); else ctx.moveTo(X(s), yOf(v));
      joined = true;
    }
    ctx.stroke();
    if (points.length < 40) {
      ctx.fillStyle = '#f57c00';
      points.forEach(([s, v]) => ctx.fillRect(X(s) - 1.5, yOf(v) - 1.5, 3, 3));
    }
    if (hover !== undefined && drawn(held[hover][1])) {
      const [s, v] = held[hover];
      ctx.fillStyle = '#212121';
      ctx.beginPath(); ctx.arc(X(s), yOf(v), 3, 0, 2 * Math.PI); ctx.fill();
    }
  };
  draw();
  canvas.addEventListener('mousemove', (e) => {
    if (!held.length) return;
    const x = e.clientX - canvas.getBoundingClientRect().left;
    let best = 0;
    held.forEach(([s], i) => { if (Math.abs(X(s) - x) < Math.abs(X(held[best][0]) - x)) best = i; });
    const [s, v] = held[best];
    draw(best);
    const text = finite(v) ? `<b>${escapeHtml(format(v))}</b>` : `<b class="bad">${escapeHtml(v)}</b>`;
    showTooltip(e, `${escapeHtml(label)}<br>step ${s}: ${text}`, v);
  });
  canvas.addEventListener('mouseleave', () => { draw(); hideTooltip(); });
  return canvas;
}
