// governor dashboard: the page. Data comes from /events (server-sent events relayed from the daemon's watch
// stream); the charts are uPlot, served beside this file. Text from the daemon is only ever set as textContent.
"use strict";
(() => {
  const STATES = ["idle", "sustained", "low_battery", "hot", "critical"]; // bottom to top, as the lab's plot
  const KEEP = 900;
  const KEEP_DECISIONS = 100;
  const COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];
  const dash = { samples: [], decisions: [], status: {}, charts: {}, zones: [], control: false, mine: [] };
  window.governorDashboard = dash; // for the curious (and the tests): what the page holds and draws

  const hash = location.hash.match(/token=([A-Za-z0-9_-]+)/);
  if (hash) {
    sessionStorage.setItem("governor-token", hash[1]);
    history.replaceState(null, "", location.pathname); // the token leaves the address bar (and screenshots)
  }
  const token = sessionStorage.getItem("governor-token");

  const $ = (id) => document.getElementById(id);
  const show = (v, unit = "") => (v === null || v === undefined ? "-" : `${v}${unit}`);
  const fixed = (v, d = 1, unit = "") => (typeof v === "number" ? `${v.toFixed(d)}${unit}` : "-");
  const clock = (wall) => new Date(wall * 1000).toLocaleTimeString([], { hour12: false });
  // Whole seconds at the least: one sample a second at most, and "08:15:30" reads better than ":30.000".
  const TIME_AXIS = {
    space: 70,
    incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200],
    values: (u, splits) => splits.map((v) => clock(v)),
  };

  function facts(dl, rows) {
    dl.replaceChildren();
    for (const [k, v] of rows) {
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = k;
      dd.textContent = v;
      dl.append(dt, dd);
    }
  }

  function cell(tr, value, cls) {
    const td = document.createElement("td");
    td.textContent = value;
    if (cls) td.className = cls;
    tr.append(td);
    return td;
  }

  // -- charts -------------------------------------------------------------------------------------------------
  function zonesOf(samples) {
    const seen = new Map();
    for (const s of samples) for (const [src, z] of Object.entries(s.zones || {})) seen.set(src, z.label);
    return [...seen.entries()].map(([source, label]) => ({ source, label }));
  }

  function size(div, height) {
    return { width: Math.max(200, div.clientWidth), height };
  }

  function make(name, div, height, series, axes, scales = {}) {
    if (dash.charts[name]) dash.charts[name].destroy();
    const opts = {
      ...size(div, height),
      scales: { x: { time: true }, ...scales },
      series: [{}, ...series],
      axes: [TIME_AXIS, ...axes],
      legend: { live: false },
    };
    dash.charts[name] = new uPlot(opts, [[]], div);
  }

  function buildCharts() {
    dash.zones = zonesOf(dash.samples);
    const temp = [];
    dash.zones.forEach((z, i) => {
      temp.push({ label: `${z.label} °C`, stroke: COLORS[i % COLORS.length], width: 2 });
    });
    dash.zones.forEach((z, i) => {
      temp.push({ label: `${z.label} trip`, stroke: COLORS[i % COLORS.length], width: 1, dash: [6, 4] });
    });
    temp.push({ label: "forecast", stroke: "#777", width: 1, dash: [2, 3] });
    make("temp", $("chart-temp"), 240, temp, [{ label: "°C" }]);
    make(
      "state",
      $("chart-state"),
      130,
      [{ label: "state", stroke: "#555", width: 2, paths: uPlot.paths.stepped({ align: 1 }) }],
      [{ size: 90, splits: () => [0, 1, 2, 3, 4], values: (u, splits) => splits.map((v) => STATES[v] || "") }],
      { y: { range: [-0.5, 4.5] } },
    );
    make(
      "rate",
      $("chart-rate"),
      180,
      [
        { label: "tokens/s", stroke: "#1f77b4", width: 2 },
        { label: "rate cap", stroke: "#1f77b4", width: 1, dash: [6, 4] },
      ],
      [{}],
      { y: { range: (u, lo, hi) => [0, Math.max(1, hi || 0)] } },
    );
    make(
      "clock",
      $("chart-clock"),
      180,
      [
        { label: "running", stroke: "#2ca02c", width: 2 },
        { label: "cap", stroke: "#d62728", width: 1, dash: [6, 4] },
      ],
      [{}],
      { y: { range: [0, 1.05] } },
    );
    $("zone-note").textContent = dash.zones.length ? "(dashed: each zone's trip; dotted: the forecast)" : "(no zone with a trip)";
  }

  function redraw() {
    const s = dash.samples;
    if (zonesOf(s).map((z) => z.source).join() !== dash.zones.map((z) => z.source).join()) buildCharts();
    const x = s.map((p) => p.wall);
    const zone = (src, key) => s.map((p) => (p.zones[src] ? p.zones[src][key] : null));
    dash.charts.temp.setData([
      x,
      ...dash.zones.map((z) => zone(z.source, "temp_c")),
      ...dash.zones.map((z) => zone(z.source, "trip_c")),
      s.map((p) => p.forecast_c),
    ]);
    dash.charts.state.setData([x, s.map((p) => (p.state ? STATES.indexOf(p.state) : null))]);
    dash.charts.rate.setData([x, s.map((p) => p.tokens_per_s), s.map((p) => p.max_tokens_per_s)]);
    dash.charts.clock.setData([x, s.map((p) => p.freq_ratio), s.map((p) => p.cap_ratio)]);
  }

  // -- text -----------------------------------------------------------------------------------------------------
  function renderStatus() {
    const st = dash.status || {};
    const state = st.state || "starting";
    $("state").textContent = state;
    $("state").className = `state ${state}`;
    $("since").textContent = st.since ? `since ${clock(st.since)}` : "";
    $("reason").textContent = st.reason || "";
    const cfg = st.config || {};
    const eng = st.engine || {};
    const sup = st.supervisor || {};
    let activity = !st.engine ? "not answering" : eng.busy ? "generating" : eng.loaded === false ? "unloaded (idle)" : "idle";
    if (sup.critical) activity = `given up: ${sup.critical}`;
    else if (sup.waiting) activity = `waiting: ${sup.waiting}`;
    facts($("engine"), [
      ["model", show(cfg.model)],
      ["threads", show(cfg.threads)],
      ["context", show(cfg.n_ctx, " tokens")],
      ["KV cache", show(cfg.kv_type)],
      ["rate cap", cfg.max_tokens_per_s ? `${cfg.max_tokens_per_s} tok/s` : "none"],
      ["n_batch", show(cfg.n_batch)],
      ["activity", activity],
      ["tokens/s", fixed(eng.tokens_per_s)],
      ["RSS", eng.rss_bytes ? `${(eng.rss_bytes / 2 ** 20).toFixed(0)} MiB` : "-"],
      ["policy", show((st.policy || {}).name)],
    ]);
    const rd = st.readings || {};
    const rows = [];
    for (const t of rd.temperatures || []) {
      const trips = (t.trips || []).map((x) => `${x.type} ${x.temp_c}`).join(", ");
      rows.push([t.label, `${fixed(t.temp_c, 1, " °C")}${trips ? ` (${trips})` : ""}`]);
    }
    const basis = st.basis || {};
    if (basis.forecast_c !== undefined) rows.push(["forecast", `${fixed(basis.forecast_c, 1, " °C")} (${show(basis.zone)})`]);
    const bat = rd.battery;
    if (bat) rows.push(["battery", `${fixed(bat.percent, 0, " %")} ${bat.charging ? "charging" : bat.plugged ? "on mains" : "discharging"}`]);
    const mem = rd.memory || {};
    if (mem.available_bytes != null) rows.push(["memory free", `${(mem.available_bytes / 2 ** 30).toFixed(1)} GiB, PSI ${fixed(mem.psi_some_avg10)} %`]);
    const freq = (st.actuators || {}).cpufreq || {};
    const capped = (freq.clusters || []).filter((c) => c.cap_khz);
    rows.push(["clock cap", capped.length ? capped.map((c) => `${c.policy} ${c.cap_khz} of ${c.max_khz}`).join(", ") : freq.writable ? "none" : "not writable here"]);
    const routing = st.routing || {};
    rows.push(["routing", routing.enabled ? `${routing.off_device ? "off the device" : "on the device"}: ${routing.reason}` : "off"]);
    facts($("device"), rows);
    renderHolds();
  }

  function renderHolds() {
    const body = $("holds").tBodies[0];
    body.replaceChildren();
    for (const h of (dash.status || {}).holds || []) {
      const tr = document.createElement("tr");
      cell(tr, `#${h.id}`);
      const asks = ["state", "max_threads", "max_tokens_per_s", "max_tier", "max_ctx"]
        .filter((k) => h[k] !== null && h[k] !== undefined)
        .map((k) => `${k} ${h[k]}`)
        .join(", ");
      cell(tr, asks);
      cell(tr, h.owner);
      cell(tr, h.expires_in_s == null ? "until released" : `${Math.round(h.expires_in_s)} s`);
      const td = cell(tr, "");
      if (dash.control && dash.mine.includes(h.id)) {
        const b = document.createElement("button");
        b.textContent = "release";
        b.addEventListener("click", () => act("DELETE", `/api/hold/${h.id}`));
        td.append(b);
      }
      body.append(tr);
    }
  }

  function renderDecisions() {
    const body = $("decisions").tBodies[0];
    body.replaceChildren();
    for (const d of dash.decisions.slice().reverse()) {
      const tr = document.createElement("tr");
      cell(tr, clock(d.wall));
      cell(tr, d.state, `st-${d.state}`);
      cell(tr, d.rule);
      cell(tr, d.reason);
      body.append(tr);
    }
  }

  function ageTick() {
    const last = dash.samples[dash.samples.length - 1];
    $("updated").textContent = last && last.wall ? `updated ${Math.max(0, Math.round(Date.now() / 1000 - last.wall))} s ago` : "";
  }

  // -- holds and reload (with the token) ------------------------------------------------------------------------
  async function act(method, path, body) {
    const said = $("control-said");
    said.textContent = "…";
    try {
      const r = await fetch(path, {
        method,
        headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
      });
      const answer = await r.json();
      if (!r.ok || answer.ok === false) said.textContent = `refused: ${answer.error || r.status}`;
      else if (answer.hold !== undefined) said.textContent = `holding #${answer.hold}`;
      else if (answer.released !== undefined) said.textContent = `released #${answer.released}`;
      else said.textContent = `policy reloaded: ${answer.policy || "ok"}`;
    } catch (e) {
      said.textContent = `failed: ${e}`;
    }
  }

  function setupControl() {
    const form = $("control");
    const select = form.elements.state;
    for (const s of STATES) {
      const o = document.createElement("option");
      o.value = o.textContent = s;
      select.append(o);
    }
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const ask = {};
      if (select.value) ask.state = select.value;
      for (const k of ["max_threads", "max_tokens_per_s", "ttl_s"]) {
        const v = form.elements[k].value;
        if (v !== "") ask[k] = Number(v);
      }
      act("POST", "/api/hold", ask);
    });
    $("reload-button").addEventListener("click", () => act("POST", "/api/reload"));
  }

  function setControl(allowed) {
    dash.control = Boolean(allowed && token);
    $("control").hidden = !dash.control;
    $("read-only").hidden = dash.control;
  }

  // -- the stream -----------------------------------------------------------------------------------------------
  function down(text) {
    $("down").hidden = !text;
    $("down").textContent = text || "";
  }

  function take(data, replace) {
    if (replace) dash.decisions = [];
    dash.samples.push(data.sample);
    if (dash.samples.length > KEEP) dash.samples.splice(0, dash.samples.length - KEEP);
    dash.decisions.push(...(data.decisions || []));
    if (dash.decisions.length > KEEP_DECISIONS) dash.decisions.splice(0, dash.decisions.length - KEEP_DECISIONS);
    dash.status = data.status;
    dash.mine = data.mine || [];
    down(null);
    redraw();
    renderStatus();
    renderDecisions();
    ageTick();
  }

  function connect() {
    const es = new EventSource("/events");
    es.addEventListener("hello", (e) => {
      const data = JSON.parse(e.data);
      dash.samples = data.samples;
      dash.decisions = data.decisions;
      dash.status = data.status;
      dash.mine = data.mine || [];
      setControl(data.control);
      buildCharts();
      redraw();
      renderStatus();
      renderDecisions();
      ageTick();
      down(data.down ? `governor not reachable: ${data.down}` : null);
    });
    es.addEventListener("tick", (e) => take(JSON.parse(e.data), false));
    es.addEventListener("up", (e) => take(JSON.parse(e.data), true));
    es.addEventListener("down", (e) => down(`governor not reachable: ${JSON.parse(e.data).error}`));
    es.addEventListener("error", () => down("the dashboard is not answering; retrying"));
  }

  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(dash.charts)) {
      const div = $(`chart-${name}`);
      chart.setSize(size(div, chart.height));
    }
  });

  setupControl();
  setControl(false);
  connect();
  setInterval(ageTick, 1000);
})();
