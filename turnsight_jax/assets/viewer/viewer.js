// The trajectory viewer (turnsight_jax.viewer): renders the records embedded in #records-data.
// Every number shown carries its exact value in data-value (the record's JSON number), so a test
// can read it back. Text from the records (model output, tool results) is only ever set as
// textContent, never parsed as HTML.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("records-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const state = { step: null, sort: "order", disagree: false, opposes: false, category: "", outcome: "", open: new Set() };

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) e.setAttribute(k, String(v));
    }
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = String(text);
    return e;
  }
  // A per-turn value is a number (constant over the turn: exact), {mean, min, max} (it varies over
  // the turn's tokens) or null (absent).
  function scalar(v) {
    if (v === null || v === undefined) return null;
    return typeof v === "object" ? v.mean : v;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "—";
    if (typeof v === "object") return "~" + fmt(v.mean);
    if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
    if (v === 0 || Math.abs(v) >= 1e-3) return v.toFixed(3);
    return v.toExponential(2);
  }
  function numCell(field, v, extraClass) {
    const td = el("td", { "data-field": field, class: extraClass });
    td.textContent = fmt(v);
    if (v !== null && v !== undefined) {
      if (typeof v === "object") {
        td.setAttribute("data-value", String(v.mean));
        td.setAttribute("data-min", String(v.min));
        td.setAttribute("data-max", String(v.max));
        td.setAttribute("data-varies", "1");
        td.title = "varies over the turn's tokens: mean " + v.mean + ", min " + v.min + ", max " + v.max;
      } else {
        td.setAttribute("data-value", String(v));
        td.title = String(v);
      }
    }
    return td;
  }

  function stepEntries() { return DATA.steps; }
  function currentStep() { return DATA.steps.find((s) => s.step === state.step) || null; }

  // Every turn of a step as a flat row, with what the filters and sorts read.
  function turnRows(step) {
    const rows = [];
    for (const traj of step.trajectories) {
      for (const turn of traj.turns) {
        const base = scalar(turn.base_adv), adv = scalar(turn.adv);
        const shift = base === null || adv === null ? null : adv - base;
        const bad = turn.outcome === "error" || turn.outcome === "wrong";
        const opposes = shift !== null && ((shift > 0 && bad) || (shift < 0 && turn.outcome === "ok"));
        rows.push({ traj, turn, shift, opposes, weight: scalar(turn.weight) });
      }
    }
    return rows;
  }

  function passes(r) {
    if (state.disagree && r.turn.agree !== false) return false;
    if (state.opposes && !r.opposes) return false;
    if (state.category && r.traj.category !== state.category) return false;
    if (state.outcome && r.turn.outcome !== state.outcome) return false;
    return true;
  }

  const SORTS = {
    order: ["group, trajectory, turn", null],
    "weight-desc": ["weight w, high first", (r) => -(r.weight ?? -Infinity)],
    "weight-asc": ["weight w, low first", (r) => r.weight ?? Infinity],
    "shift-desc": ["Ã − A_base, high first", (r) => -(r.shift ?? -Infinity)],
    "shift-asc": ["Ã − A_base, low first", (r) => r.shift ?? Infinity],
    "dhat-abs": ["|δ̂|, high first", (r) => -Math.abs(scalar(r.turn.delta_hat) ?? 0)],
    "reward-desc": ["reward, high first", (r) => -(r.traj.reward ?? -Infinity)],
  };

  function columns(step) {
    const h = step.header;
    const has = (f) => step.trajectories.some((t) => t.turns.some((u) => u[f] !== undefined));
    const cols = [["group", "group"], ["row", "traj"], ["k", "turn"], ["category", "category"], ["reward", "reward"],
      ["outcome", "tool outcome"], ["gold_match", "gold step"], ["tokens", "tokens"], ["base_adv", "A_base"]];
    if (has("delta")) h.depths.forEach((d, i) => cols.push(["delta:" + i, "δ̄(" + d + ")"]));
    for (const [f, label] of [["vote", "vote"], ["depth", "d*"], ["delta_hat", "δ̂"], ["weight", "w"], ["gap", "gap"],
      ["rlsd_weight", "w (RLSD)"]]) {
      if (has(f)) cols.push([f, label]);
    }
    cols.push(["adv", "Ã"], ["text", "policy text"]);
    return cols;
  }

  function weightColour(w, epsW) {
    if (w === null || w === 1) return "";
    const a = Math.min(Math.abs(w - 1) / Math.max(epsW, 1e-6), 1) * 0.45 + 0.08;
    return w > 1 ? "rgba(27,122,58," + a.toFixed(3) + ")" : "rgba(179,38,30," + a.toFixed(3) + ")";
  }

  function turnRow(step, r, cols) {
    const { traj, turn } = r;
    const base = scalar(turn.base_adv);
    const tr = el("tr", {
      class: "turn " + (base === null || base === 0 ? "base-zero" : base > 0 ? "base-pos" : "base-neg"),
      id: "turn-" + step.step + "-" + traj.row + "-" + turn.k,
      "data-step": step.step, "data-row": traj.row, "data-k": turn.k, "data-group": traj.group,
      "data-outcome": turn.outcome, "data-opposes": r.opposes ? "1" : "0",
      "data-agree": turn.agree === undefined ? "" : turn.agree ? "1" : "0",
    });
    tr.style.background = weightColour(r.weight, step.header.eps_w);
    for (const [f] of cols) {
      if (f.startsWith("delta:")) {
        const i = Number(f.slice(6));
        const v = turn.delta ? turn.delta[i] : null;
        const cls = (turn.signs && turn.signs[i] > 0 ? "sign-pos" : "sign-neg") + (turn.depth_index === i ? " chosen" : "");
        tr.appendChild(numCell("delta-" + i, v, cls));
      } else if (f === "group" || f === "row" || f === "k" || f === "tokens") {
        tr.appendChild(numCell(f, f === "k" || f === "tokens" ? turn[f] : traj[f]));
      } else if (f === "reward") {
        tr.appendChild(numCell("reward", traj.reward));
      } else if (f === "category") {
        tr.appendChild(el("td", { "data-field": "category" }, traj.category || "—"));
      } else if (f === "outcome") {
        tr.appendChild(el("td", { "data-field": "outcome", class: "outcome-" + turn.outcome }, turn.outcome));
      } else if (f === "gold_match") {
        const g = turn.gold_match;
        tr.appendChild(el("td", { "data-field": "gold_match", "data-value": g === null ? "" : String(g) },
          g === null || g === undefined ? "—" : g ? "match" : "differs"));
      } else if (f === "vote") {
        const v = turn.vote;
        tr.appendChild(numCell("vote", v === undefined ? null : v, v > 0 ? "sign-pos" : "sign-neg"));
      } else if (f === "text") {
        const text = turn.text || "";
        tr.appendChild(el("td", { class: "text", "data-field": "text", title: text }, text.length > 120 ? text.slice(0, 120) + "…" : text));
      } else {
        tr.appendChild(numCell(f, turn[f] === undefined ? null : turn[f]));
      }
    }
    tr.addEventListener("click", () => {
      const key = tr.id;
      if (state.open.has(key)) state.open.delete(key); else state.open.add(key);
      renderTable();
    });
    return tr;
  }

  function pre(text) { return el("pre", {}, text); }

  function detailsRow(step, r, span) {
    const { traj, turn } = r;
    const tr = el("tr", { class: "details", id: "details-" + step.step + "-" + traj.row + "-" + turn.k });
    const td = el("td", { colspan: span });
    td.appendChild(el("h3", {}, "Prompt (task " + traj.task_id + ", " + (traj.data_source || "no source") + ")"));
    td.appendChild(pre(traj.prompt || ""));
    td.appendChild(el("h3", {}, "Turn " + turn.k + ": policy text"));
    td.appendChild(pre(turn.text || ""));
    turn.calls.forEach((c, i) => {
      const head = c.error !== undefined ? "call " + i + ": failed to parse" : "call " + i + ": " + c.name +
        (c.failed ? " (tool error)" : "") + (c.in_gold === false ? " (not in the gold chain)" : c.in_gold ? " (in the gold chain)" : "");
      td.appendChild(el("h3", {}, head));
      td.appendChild(pre(c.error !== undefined ? c.error + "\n" + (c.raw || "") : JSON.stringify(c.arguments)));
      if (i < turn.observations.length) {
        td.appendChild(el("h3", {}, "observation " + i));
        td.appendChild(pre(turn.observations[i]));
      }
    });
    if (turn.gold_step !== null && turn.gold_step !== undefined) {
      td.appendChild(el("h3", {}, "gold chain, step " + turn.k));
      td.appendChild(pre(JSON.stringify(turn.gold_step)));
    }
    const facts = { "final reward": traj.reward, "finish": traj.finish_reason, "gold answer": traj.gold_answer,
      "group μ": traj.group_mean, "group σ": traj.group_std, signals: JSON.stringify(traj.signals) };
    if (turn.terms) facts["loss terms (first update)"] = JSON.stringify(turn.terms);
    td.appendChild(el("h3", {}, "Trajectory"));
    td.appendChild(pre(Object.entries(facts).filter(([, v]) => v !== undefined).map(([k, v]) => k + ": " + v).join("\n")));
    tr.appendChild(td);
    return tr;
  }

  function renderTable() {
    const step = currentStep();
    const head = document.getElementById("turns-head");
    const body = document.getElementById("turns-body");
    head.replaceChildren();
    body.replaceChildren();
    if (!step) {
      body.appendChild(el("tr", {}, null)).appendChild(el("td", { class: "empty" }, "no readable records"));
      return;
    }
    const cols = columns(step);
    const htr = el("tr");
    for (const [, label] of cols) htr.appendChild(el("th", { class: label === "policy text" ? "text" : "" }, label));
    head.appendChild(htr);
    let rows = turnRows(step).filter(passes);
    const key = SORTS[state.sort][1];
    if (key) rows = rows.map((r, i) => [key(r), i, r]).sort((a, b) => a[0] - b[0] || a[1] - b[1]).map((x) => x[2]);
    let lastGroup = null, lastTraj = null;
    for (const r of rows) {
      if (!key) {  // the hierarchy: a head row per prompt group and per trajectory
        if (r.traj.group !== lastGroup) {
          const g = el("tr", { class: "group-head", "data-group": r.traj.group });
          g.appendChild(el("td", { colspan: cols.length }, (r.traj.group < 0 ? "rows in no group" : "prompt group " +
            r.traj.group) + " · " + (r.traj.category || "") +
            " · task " + r.traj.task_id + (r.traj.group_mean !== undefined ? " · μ " + fmt(r.traj.group_mean) +
              ", σ " + fmt(r.traj.group_std) : "")));
          body.appendChild(g);
          lastGroup = r.traj.group;
        }
        if (r.traj !== lastTraj) {
          const t = el("tr", { class: "traj-head", "data-row": r.traj.row });
          t.appendChild(el("td", { colspan: cols.length }, "trajectory " + r.traj.row + " · reward " + fmt(r.traj.reward) +
            " · " + r.traj.num_turns + " turns · " + r.traj.finish_reason));
          body.appendChild(t);
          lastTraj = r.traj;
        }
      }
      const tr = turnRow(step, r, cols);
      body.appendChild(tr);
      if (state.open.has(tr.id)) body.appendChild(detailsRow(step, r, cols.length));
    }
    document.getElementById("turn-count").textContent = rows.length + " turns shown";
    document.getElementById("turn-count").setAttribute("data-value", String(rows.length));
  }

  // ---- per-step aggregates ----
  function bars(svgEl, items, opts) {
    // items: [{label, value, lo, hi, attrs}]; a bar per item, optional min-max whisker
    svgEl.replaceChildren();
    const w = Number(svgEl.getAttribute("width")), h = Number(svgEl.getAttribute("height"));
    if (!items.length) {  // e.g. a method without TurnSight's depths or weights
      svgEl.appendChild(svg("text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" }, opts.empty));
      return;
    }
    const pad = { l: 34, r: 6, t: 8, b: 22 };
    const top = Math.max(opts.top ?? 0, ...items.map((i) => Math.max(i.value ?? 0, i.hi ?? 0)), 1e-9);
    const bottom = opts.bottom ?? 0;
    const y = (v) => pad.t + (h - pad.t - pad.b) * (1 - (v - bottom) / Math.max(top - bottom, 1e-9));
    svgEl.appendChild(svg("line", { x1: pad.l, y1: y(bottom), x2: w - pad.r, y2: y(bottom), stroke: "#9aa1b0" }));
    for (const t of [bottom, top]) svgEl.appendChild(svg("text", { x: 2, y: y(t) + 3 }, fmt(t)));
    if (opts.ref !== undefined) {
      svgEl.appendChild(svg("line", { x1: pad.l, y1: y(opts.ref), x2: w - pad.r, y2: y(opts.ref), stroke: "#9aa1b0",
        "stroke-dasharray": "3,3" }));
    }
    const slot = (w - pad.l - pad.r) / Math.max(items.length, 1);
    items.forEach((it, i) => {
      const x = pad.l + slot * i + slot * 0.2, bw = slot * 0.6;
      if (it.value !== null && it.value !== undefined) {
        const y0 = y(Math.max(Math.min(it.value, top), bottom));
        svgEl.appendChild(svg("rect", { x, y: Math.min(y0, y(bottom)), width: bw, height: Math.max(Math.abs(y(bottom) - y0), 1),
          fill: opts.colour, ...it.attrs }));
      }
      if (it.lo !== undefined && it.lo !== null) {
        svgEl.appendChild(svg("line", { x1: x + bw / 2, x2: x + bw / 2, y1: y(it.lo), y2: y(it.hi), stroke: "#1d2330" }));
      }
      svgEl.appendChild(svg("text", { x: x + bw / 2, y: h - 8, "text-anchor": "middle" }, it.label));
    });
  }

  function renderAggregates(step) {
    const rows = step ? turnRows(step) : [];
    const depths = step ? step.header.depths : [];
    const counts = depths.map(() => 0);
    let agree = 0, withAgree = 0, amplified = 0, damped = 0, weighted = 0;
    for (const r of rows) {
      const di = r.turn.depth_index;
      if (typeof di === "number" && di >= 0 && di < counts.length) counts[di] += 1;
      if (r.turn.agree !== undefined) { withAgree += 1; if (r.turn.agree) agree += 1; }
      if (r.weight !== null && r.weight !== undefined) {
        weighted += 1;
        if (r.weight > 1) amplified += 1;
        if (r.weight < 1) damped += 1;
      }
    }
    const anyDepth = rows.some((r) => typeof r.turn.depth_index === "number");
    bars(document.getElementById("depth-histogram"), anyDepth ? depths.map((d, i) => ({
      label: "d=" + d, value: counts[i], attrs: { "data-depth": d, "data-count": counts[i] } })) : [],
    { colour: "#2f6fd0", empty: "no chosen depths in these records" });
    const share = (n, of) => (of ? n / of : null);
    const setStat = (id, v, text) => {
      const e = document.getElementById(id);
      e.textContent = text !== undefined ? text : v === null ? "—" : (100 * v).toFixed(1) + "%";
      e.setAttribute("data-value", v === null ? "" : String(v));
    };
    setStat("agg-agreement", share(agree, withAgree));
    setStat("agg-amplified", share(amplified, weighted));
    setStat("agg-damped", share(damped, weighted));
    setStat("agg-turns", rows.length, String(rows.length));
    setStat("agg-trajectories", step ? step.trajectories.length : 0, String(step ? step.trajectories.length : 0));
    const groups = step ? new Set(step.trajectories.map((t) => t.group)).size : 0;
    setStat("agg-groups", groups, String(groups));
    // weight by turn position k
    const byK = new Map();
    for (const r of rows) {
      if (r.weight === null || r.weight === undefined) continue;
      const s = byK.get(r.turn.k) || { n: 0, sum: 0, lo: Infinity, hi: -Infinity };
      s.n += 1; s.sum += r.weight; s.lo = Math.min(s.lo, r.weight); s.hi = Math.max(s.hi, r.weight);
      byK.set(r.turn.k, s);
    }
    const ks = [...byK.keys()].sort((a, b) => a - b);
    const epsW = step ? step.header.eps_w : 0.5;
    bars(document.getElementById("weight-by-position"), ks.map((k) => {
      const s = byK.get(k);
      return { label: "k=" + k, value: s.sum / s.n, lo: s.lo, hi: s.hi,
        attrs: { "data-k": k, "data-mean": s.sum / s.n, "data-n": s.n, "data-min": s.lo, "data-max": s.hi } };
    }), { colour: "#7aa7e6", bottom: Math.min(1 - epsW, ...ks.map((k) => byK.get(k).lo)),
      top: Math.max(1 + epsW, ...ks.map((k) => byK.get(k).hi)), ref: 1, empty: "no TurnSight weights in these records" });
    // weight by tool outcome
    const table = document.getElementById("weight-by-outcome");
    table.replaceChildren();
    const hr = el("tr");
    for (const [t, title] of [["outcome", ""], ["turns", ""], ["mean w", ""], ["w > 1", "share amplified"],
      ["w < 1", "share damped"], ["Ã − A", "mean Ã − A_base"]]) hr.appendChild(el("th", { title }, t));
    table.appendChild(hr);
    for (const o of ["error", "wrong", "ok", "none"]) {
      const sel = rows.filter((r) => r.turn.outcome === o);
      if (!sel.length) continue;
      const ws = sel.map((r) => r.weight).filter((w) => w !== null && w !== undefined);
      const shifts = sel.map((r) => r.shift).filter((s) => s !== null);
      const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
      const tr = el("tr", { "data-outcome": o });
      tr.appendChild(el("td", { class: "outcome-" + o }, o));
      tr.appendChild(numCell("turns", sel.length));
      tr.appendChild(numCell("mean_weight", mean(ws)));
      tr.appendChild(numCell("amplified", ws.length ? ws.filter((w) => w > 1).length / ws.length : null));
      tr.appendChild(numCell("damped", ws.length ? ws.filter((w) => w < 1).length / ws.length : null));
      tr.appendChild(numCell("mean_shift", mean(shifts)));
      table.appendChild(tr);
    }
  }

  function renderStepInfo(step) {
    const info = document.getElementById("step-info");
    const method = document.getElementById("step-method");
    if (!step) { info.textContent = ""; method.textContent = ""; return; }
    const h = step.header;
    method.textContent = "method " + h.method + (h.base ? " over " + h.base : "") +
      (h.teacher ? " · teacher views: " + h.teacher : "");
    const parts = ["step " + h.step + " (metrics.jsonl numbering)", "depths " + JSON.stringify(h.depths),
      "selection " + h.selection, "aggregation " + h.aggregation, "λ " + h.lam, "ε_w " + h.eps_w,
      step.trajectories.length + " trajectories recorded" + (h.dropped ? ", " + h.dropped + " left out by the size bound" : "")];
    if (step.metrics) {
      for (const [k, v] of Object.entries(step.metrics)) parts.push(k + " " + (typeof v === "number" ? fmt(v) : JSON.stringify(v)));
    }
    info.textContent = parts.join(" · ");
  }

  function fillSelect(id, options, value) {
    const s = document.getElementById(id);
    s.replaceChildren();
    for (const [v, label] of options) {
      const o = el("option", { value: v }, label);
      if (String(v) === String(value)) o.selected = true;
      s.appendChild(o);
    }
  }

  function renderControls(step) {
    const cats = step ? [...new Set(step.trajectories.map((t) => t.category || ""))].filter((c) => c).sort() : [];
    if (state.category && !cats.includes(state.category)) state.category = "";
    fillSelect("filter-category", [["", "all"], ...cats.map((c) => [c, c])], state.category);
    const outs = step ? [...new Set(turnRows(step).map((r) => r.turn.outcome))].sort() : [];
    if (state.outcome && !outs.includes(state.outcome)) state.outcome = "";
    fillSelect("filter-outcome", [["", "all"], ...outs.map((o) => [o, o])], state.outcome);
    fillSelect("sort-key", Object.entries(SORTS).map(([k, v]) => [k, v[0]]), state.sort);
    document.getElementById("filter-disagree").checked = state.disagree;
    document.getElementById("filter-opposes").checked = state.opposes;
  }

  function render() {
    const step = currentStep();
    renderStepInfo(step);
    renderControls(step);
    renderAggregates(step);
    renderTable();
  }

  function showStep(step) {
    if (!DATA.steps.some((s) => s.step === step)) throw new Error("no records of step " + step);
    state.step = step;
    state.open.clear();
    document.getElementById("step-select").value = String(step);
    render();
  }

  function setFilter(name, value) {
    if (!["disagree", "opposes", "category", "outcome"].includes(name)) throw new Error("unknown filter " + name);
    state[name] = value;
    render();
  }

  function setSort(key) {
    if (!(key in SORTS)) throw new Error("unknown sort " + key);
    state.sort = key;
    renderTable();
  }

  function init() {
    document.getElementById("run-name").textContent = DATA.run;
    document.title = "TurnSight records: " + DATA.run;
    const problems = document.getElementById("problems");
    if (DATA.problems.length) {
      const box = el("div", { class: "problems" });
      box.appendChild(el("h2", {}, DATA.problems.length + " records file(s) could not be read and are left out"));
      for (const p of DATA.problems) box.appendChild(el("div", { class: "problem", "data-file": p.file }, p.file + ": " + p.message));
      problems.appendChild(box);
    }
    fillSelect("step-select", stepEntries().map((s) => [s.step, s.step]), null);
    document.getElementById("step-select").addEventListener("change", (e) => showStep(Number(e.target.value)));
    document.getElementById("filter-disagree").addEventListener("change", (e) => setFilter("disagree", e.target.checked));
    document.getElementById("filter-opposes").addEventListener("change", (e) => setFilter("opposes", e.target.checked));
    document.getElementById("filter-category").addEventListener("change", (e) => setFilter("category", e.target.value));
    document.getElementById("filter-outcome").addEventListener("change", (e) => setFilter("outcome", e.target.value));
    document.getElementById("sort-key").addEventListener("change", (e) => setSort(e.target.value));
    window.viewer = { showStep, setFilter, setSort, state, data: DATA };
    if (DATA.steps.length) showStep(DATA.steps[DATA.steps.length - 1].step); else render();
    document.body.setAttribute("data-ready", "1");
  }

  init();
})();
