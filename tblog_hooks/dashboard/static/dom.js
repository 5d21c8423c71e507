/**
 * @file Small DOM and canvas helpers: elements and SVG elements built in one call, HTML escaped,
 * rows chosen with the keyboard, and the labels' font, width and shortening on a canvas.
 */

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === 'class') node.className = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child !== null) node.append(child);
  return node;
}

const SVG = 'http://www.w3.org/2000/svg';

export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

export const escapeHtml = (s) => String(s).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' })[c]);

// `node` reached with Tab and chosen with Enter or Space, as with a click.
export function chooseable(node) {
  node.tabIndex = 0;
  node.addEventListener('keydown', (event) => {
    if (event.key !== 'Enter' && event.key !== ' ') return;
    event.preventDefault();
    node.click();
  });
  return node;
}

// The font of the maps' and legends' labels.
export const LABEL_FONT = '11px Roboto, Arial, sans-serif';
const measurer = document.createElement('canvas').getContext('2d');

export function textWidth(text) {
  measurer.font = LABEL_FONT;
  return measurer.measureText(text).width;
}

// `text` as it fits in `width` on `ctx`: whole, else its end after an ellipsis.
export function ellipsis(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let keep = text.length;
  while (keep > 1 && ctx.measureText(`…${text.slice(text.length - keep)}`).width > width) keep--;
  return `…${text.slice(text.length - keep)}`;  // the end of a name tells modules apart
}
