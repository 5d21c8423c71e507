/**
 * @file The one tooltip every map and chart shows on hover: its HTML, and the value under the
 * pointer in its `data-value` (for scripts and the browser tests).
 */

import { el } from './dom.js';

export const tooltip = el('div', { class: 'tooltip', id: 'tooltip' });

export function showTooltip(event, html, value) {
  tooltip.innerHTML = html;
  tooltip.dataset.value = value === undefined ? '' : String(value);
  tooltip.style.display = 'block';
  const x = Math.min(event.clientX + 14, innerWidth - tooltip.offsetWidth - 4);
  const y = Math.min(event.clientY + 14, innerHeight - tooltip.offsetHeight - 4);
  tooltip.style.left = `${x}px`;
  tooltip.style.top = `${y}px`;
}

export const hideTooltip = () => { tooltip.style.display = 'none'; };
