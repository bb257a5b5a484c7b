// Time-series line charts drawn as inline SVG (no third-party code).
// LoraCharts.line(svg, t, series, opts): t = unix seconds, series = [{name, values}], values may hold
// null (no observation: the line breaks there); opts = {format(v) -> string, windowS}.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 320, H = 110, L = 44, R = 6, T = 16, B = 16;  // viewBox and padding

  function el(name, attrs, text) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function line(svg, t, series, opts) {
    const format = opts.format || String;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const now = t.length ? t[t.length - 1] : Date.now() / 1000;
    // Up to the last 15 minutes; while the server is younger, just the time it has been up (>= 2 min).
    const windowS = Math.min(opts.windowS || 900, Math.max(120, t.length ? now - t[0] : 0));
    const x0 = now - windowS;
    let top = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > top) top = v;
    top = opts.maxValue !== undefined ? Math.max(opts.maxValue, top) : niceMax(top);
    const x = (ts) => L + ((ts - x0) / windowS) * (W - L - R);
    const y = (v) => T + (1 - v / top) * (H - T - B);
    svg.appendChild(el("line", {x1: L, y1: y(0), x2: W - R, y2: y(0), class: "axis"}));
    svg.appendChild(el("line", {x1: L, y1: y(top), x2: W - R, y2: y(top), class: "grid"}));
    svg.appendChild(el("text", {x: L - 4, y: y(top) + 4, class: "tick", "text-anchor": "end"}, format(top)));
    svg.appendChild(el("text", {x: L - 4, y: y(0), class: "tick", "text-anchor": "end"}, format(0)));
    svg.appendChild(el("text", {x: L, y: H - 3, class: "tick"}, `-${Math.round(windowS / 60)} min`));
    svg.appendChild(el("text", {x: W - R, y: H - 3, class: "tick", "text-anchor": "end"}, "now"));
    series.forEach((s, i) => {
      let points = [];
      const flush = () => {
        if (points.length === 1) {
          const [px, py] = points[0].split(",");
          svg.appendChild(el("circle", {cx: px, cy: py, r: 1.8, class: `dot s${i}`}));
        } else if (points.length > 1) {
          svg.appendChild(el("polyline", {points: points.join(" "), class: `series s${i}`}));
        }
        points = [];
      };
      s.values.forEach((v, k) => {
        if (v === null || v === undefined || t[k] < x0) { flush(); return; }
        points.push(`${x(t[k]).toFixed(1)},${y(v).toFixed(1)}`);
      });
      flush();
    });
    if (series.length > 1) {
      // Legend right-aligned on the top line, last series rightmost.
      let legendX = W - R;
      for (let i = series.length - 1; i >= 0; i--) {
        svg.appendChild(el("text", {x: legendX, y: 9, class: `legend s${i}`, "text-anchor": "end"},
          series[i].name));
        legendX -= 6 * series[i].name.length + 8;
      }
    }
  }

  window.LoraCharts = {line};
})();
