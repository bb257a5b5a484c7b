// The console's few behaviours: confirm dialogs, copy-to-clipboard, and the Overview's live refresh.
"use strict";
(function () {
  const fmt = {
    seconds: (v) => (v === null || v === undefined) ? "–" : (v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`),
    percent: (v) => (v === null || v === undefined) ? "–" : `${(v * 100).toFixed(1)}%`,
    count: (v) => (v === null || v === undefined) ? "–" : String(Math.round(v)),
    bytes: (v) => {
      if (v === null || v === undefined) return "–";
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0;
      while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
      return i === 0 ? `${Math.round(v)} B` : `${v.toFixed(1)} ${units[i]}`;
    },
  };

  document.addEventListener("submit", (event) => {
    const form = event.target;
    if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) event.preventDefault();
  });

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-copy]");
    if (!button) return;
    const text = document.getElementById(button.dataset.copy).textContent;
    navigator.clipboard.writeText(text).then(() => { button.textContent = "Copied"; }, () => {});
  });

  // "ttft.p50" -> data.numbers.ttft.p50; "residency.gpu.used" -> data.residency.gpu.used
  function lookup(data, path) {
    const parts = path.split(".");
    let node = parts[0] in data ? data : data.numbers;
    for (const p of parts) {
      if (node === null || node === undefined) return undefined;
      node = node[p];
    }
    return node;
  }

  function render(data) {
    for (const node of document.querySelectorAll("[data-num]")) {
      const value = lookup(data, node.dataset.num);
      if (value === undefined) continue;
      node.textContent = (fmt[node.dataset.format] || fmt.count)(value);
    }
    const alarms = document.getElementById("alarms");
    alarms.replaceChildren();
    for (const alarm of data.alarms) {
      const div = document.createElement("div");
      div.className = "alarm";
      div.dataset.kind = alarm.kind;
      div.textContent = alarm.message;
      alarms.appendChild(div);
    }
    if (!data.alarms.length) {
      const div = document.createElement("div");
      div.className = "no-alarm";
      div.textContent = "No alarms.";
      alarms.appendChild(div);
    }
    if (!window.LoraCharts) return;
    for (const svg of document.querySelectorAll("svg.chart")) {
      const names = svg.dataset.series.split(",");
      const series = names.map((name) => ({name: name.split("_").pop(), values: data.series[name] || []}));
      const format = fmt[svg.dataset.format] || fmt.count;
      const opts = {format, windowS: data.window_s || 900};
      if (svg.dataset.format === "percent") opts.maxValue = 1;
      window.LoraCharts.line(svg, data.t, series, opts);
    }
  }

  function startRefresh() {
    const status = document.getElementById("refreshed");
    if (!status) return;
    const url = status.dataset.refreshUrl;
    const every = Number(status.dataset.intervalMs) || 2000;
    const initial = document.getElementById("overview-data");
    if (initial) render(JSON.parse(initial.textContent));
    const tick = async () => {
      try {
        const response = await fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}});
        if (response.status === 401) {
          status.textContent = "session ended: reload the page to sign in again";
          status.classList.add("error");
          return;  // stop polling
        }
        const data = await response.json();
        render(data);
        status.textContent = `live · updated ${new Date(data.now * 1000).toLocaleTimeString()}`;
        status.dataset.updatedAt = String(data.now);
      } catch (err) {
        status.textContent = `refresh failed (${err}); retrying`;
      }
      window.setTimeout(tick, every);
    };
    window.setTimeout(tick, every);
  }

  document.addEventListener("DOMContentLoaded", startRefresh);
})();
