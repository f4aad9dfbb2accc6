// kiloserve gateway dashboard: polls dashboard/state and redraws. Vanilla JS, no
// dependencies, no network access beyond the gateway itself. Every value from the
// server is written with textContent (never innerHTML).
"use strict";

(() => {
  const STATE_URL = "dashboard/state";
  const SVG_NS = "http://www.w3.org/2000/svg";
  let intervalMs = 1000;

  function h(tag, props, children) {
    const node = document.createElement(tag);
    const p = props || {};
    if (p.cls) node.className = p.cls;
    if (p.text !== undefined) node.textContent = String(p.text);
    if (p.title) node.title = p.title;
    if (p.data) for (const [k, v] of Object.entries(p.data)) node.dataset[k] = String(v);
    for (const child of children || []) if (child) node.appendChild(child);
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function num(v, digits) {
    if (v === null || v === undefined) return "\u2013";
    const d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) : digits;
    return Number(v).toFixed(d);
  }

  function pct(v) {
    return v === null || v === undefined ? "\u2013" : (100 * v).toFixed(1) + "%";
  }

  // One polyline per run of non-null points, so gaps show where there were no samples.
  function runs(values, width, height, maxValue) {
    const out = [];
    let cur = [];
    const n = values.length;
    const step = n > 1 ? width / (n - 1) : width;
    values.forEach((v, i) => {
      if (v === null || v === undefined) {
        if (cur.length) out.push(cur);
        cur = [];
        return;
      }
      const y = height - 2 - (maxValue > 0 ? (v / maxValue) * (height - 4) : 0);
      cur.push((i * step).toFixed(1) + "," + y.toFixed(1));
    });
    if (cur.length) out.push(cur);
    return out;
  }

  function sparkline(series, width, height) {
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none" });
    root.appendChild(svg("line", { class: "base", x1: 0, y1: height - 1, x2: width, y2: height - 1 }));
    let maxValue = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > maxValue) maxValue = v;
    for (const s of series) {
      for (const run of runs(s.values, width, height, maxValue)) {
        const pts = run.length === 1 ? [run[0], run[0].replace(/^[^,]+/, (x) => String(+x + 1.5))] : run;
        root.appendChild(svg("polyline", { class: s.cls, points: pts.join(" ") }));
      }
    }
    return root;
  }

  function latencyCell(lat, p50Key, p95Key) {
    const p50 = lat[p50Key] || [];
    const p95 = lat[p95Key] || [];
    const last50 = p50.length ? p50[p50.length - 1] : null;
    const last95 = p95.length ? p95[p95.length - 1] : null;
    const chart = sparkline(
      [{ values: p95, cls: "spark-p95" }, { values: p50, cls: "spark-p50" }], 110, 26);
    const text = h("span", {}, [
      h("span", { cls: "key-p50", text: num(last50) }),
      h("span", { text: " / " }),
      h("span", { cls: "key-p95", text: num(last95) }),
    ]);
    const wrap = h("div", { cls: "lat" }, [text]);
    wrap.prepend(chart);
    return h("td", {}, [wrap]);
  }

  function kvCell(usage) {
    const fill = h("div", { cls: "fill" + (usage !== null && usage > 0.92 ? " high" : "") });
    fill.style.width = usage === null || usage === undefined ? "0" : Math.min(100, 100 * usage) + "%";
    return h("td", {}, [h("div", { cls: "kv" }, [
      h("div", { cls: "track" }, [fill]), h("span", { text: pct(usage) }),
    ])]);
  }

  function withWhy(main, why, cls) {
    return h("td", { cls: cls || "" }, [main, h("span", { cls: "why", text: why, title: why })]);
  }

  function backendRow(b) {
    const badge = h("span", { cls: "badge state-" + b.state, text: b.state, title: b.state_why });
    const weight = h("span", { text: `${num(b.effective_weight)} of ${num(b.weight)}` });
    const name = h("td", { cls: "name" }, [h("strong", { text: b.name }),
      h("span", { cls: "why", text: [b.group, b.engine, b.version].filter(Boolean).join(" \u00b7 ") })]);
    const row = h("tr", { cls: b.routable ? "" : "not-routable", data: { backend: b.name, state: b.state } }, [
      name,
      h("td", { cls: "nowrap", text: b.pools.join(", ") || "(discovering)" }),
      h("td", { cls: "nowrap", text: b.gpu || "\u2013" }),
      withWhy(badge, b.state_why, "health"),
      withWhy(weight, b.weight_why, "weight"),
      h("td", { cls: "num", text: b.in_flight }),
      h("td", { cls: "num", text: num(b.num_running, 0) }),
      h("td", { cls: "num", text: num(b.num_waiting, 0) }),
      kvCell(b.kv_usage),
      latencyCell(b.latency_ms, "ttft_p50", "ttft_p95"),
      latencyCell(b.latency_ms, "tpot_p50", "tpot_p95"),
    ]);
    return row;
  }

  function poolRow(p) {
    return h("tr", { data: { pool: p.pool } }, [
      h("td", {}, [h("strong", { text: p.pool })]),
      h("td", { text: `${p.num_routable} of ${p.num_backends}` }),
      h("td", { text: p.gpus.join(", ") || "\u2013" }),
      h("td", { cls: "num", text: p.in_flight }),
      h("td", { cls: "num", text: num(p.num_running, 0) }),
      h("td", { cls: "num", text: num(p.num_waiting, 0) }),
      kvCell(p.kv_usage_mean),
      h("td", { cls: "num", text: num(p.req_per_s) }),
      h("td", { cls: "num", text: num(p.err_per_s) }),
    ]);
  }

  function decisionRow(d) {
    const t = new Date(d.t_wall_s * 1000);
    const time = t.toLocaleTimeString([], { hour12: false }) + "." + String(t.getMilliseconds()).padStart(3, "0");
    return h("tr", { data: { backend: d.backend } }, [
      h("td", { text: time }),
      h("td", { text: d.model }),
      h("td", { text: d.policy }),
      h("td", {}, [h("strong", { text: d.backend })]),
      h("td", { cls: "num", text: d.num_candidates }),
      h("td", { text: d.reason || "\u2013" }),
      h("td", { cls: "rid", text: d.request_id.slice(0, 24), title: d.request_id }),
    ]);
  }

  function shareRow(s, total) {
    const fill = h("div", { cls: "fill" });
    fill.style.width = (total ? (100 * s.count) / total : 0) + "%";
    return h("div", { cls: "share", data: { policy: s.policy, backend: s.backend } }, [
      h("span", {}, [h("span", { cls: "muted", text: s.policy + " \u2192 " }), h("strong", { text: s.backend })]),
      h("div", { cls: "track" }, [fill]),
      h("span", { cls: "count", text: `${s.count} (${Math.round((100 * s.count) / (total || 1))}%)` }),
    ]);
  }

  function fillBody(tableId, rows, emptyText, numCols) {
    const body = document.querySelector(`#${tableId} tbody`);
    const nodes = rows.length ? rows : [h("tr", {}, [h("td", { cls: "empty", text: emptyText })])];
    if (!rows.length) nodes[0].firstChild.colSpan = numCols;
    body.replaceChildren(...nodes);
  }

  function setCard(id, text) {
    document.getElementById(id).textContent = text;
  }

  function renderTotals(s) {
    const t = s.totals;
    const g = s.gateway;
    setCard("card-req", num(t.req_per_s));
    setCard("card-err", `${num(t.err_per_s)}  (${pct(t.error_ratio)})`);
    setCard("card-inflight", String(t.in_flight));
    setCard("card-backends", `${t.num_routable} of ${t.num_backends}`);
    setCard("card-policy", `policy ${g.policy}`);
    const states = {};
    for (const b of s.backends) states[b.state] = (states[b.state] || 0) + 1;
    setCard("card-states", Object.entries(states).map(([k, v]) => `${v} ${k}`).join(", "));
    document.getElementById("spark-req").replaceChildren(
      sparkline([{ values: t.req_per_s_series, cls: "spark-one" }], 240, 30));
    document.getElementById("spark-err").replaceChildren(
      sparkline([{ values: t.err_per_s_series, cls: "spark-bad" }], 240, 30));
    setCard("meta", `v${g.version} \u00b7 config ${g.config_hash} \u00b7 up ${Math.round(g.uptime_s)} s`);
    setCard("window-note", `(latency: trailing ${g.window_s} s window, one point per second)`);
  }

  function render(s) {
    intervalMs = s.gateway.refresh_interval_ms || 1000;
    renderTotals(s);
    fillBody("pools", s.pools.map(poolRow), "no pool yet (models are being discovered)", 9);
    fillBody("backends", s.backends.map(backendRow), "no backend configured", 11);
    fillBody("decisions", s.decisions.recent.map(decisionRow), "no request routed yet", 7);
    const shares = s.decisions.by_policy;
    const total = shares.reduce((a, x) => a + x.count, 0);
    const box = document.getElementById("shares");
    box.replaceChildren(...(shares.length ? shares.map((x) => shareRow(x, total))
      : [h("div", { cls: "empty", text: "no request routed yet" })]));
    setCard("shares-note", `(last ${s.decisions.num_buffered} decisions)`);
  }

  function setStatus(ok, text) {
    const el = document.getElementById("status");
    el.className = "status " + (ok ? "status-ok" : "status-bad");
    el.textContent = text;
    document.body.classList.toggle("offline", !ok);
  }

  async function poll() {
    try {
      const resp = await fetch(STATE_URL, { cache: "no-store" });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      render(await resp.json());
      setStatus(true, "live \u00b7 " + new Date().toLocaleTimeString([], { hour12: false }));
    } catch (err) {
      setStatus(false, "gateway unreachable (" + err.message + "); retrying");
    } finally {
      setTimeout(poll, intervalMs);
    }
  }

  document.addEventListener("DOMContentLoaded", poll);
})();
