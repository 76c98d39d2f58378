// kvlab view: replays a results folder's runs step by step (kvlab view, kvlab serve's /ui).
// The data (a JSON script element, or /ui/data when live) holds per run: steps (steps.csv's
// columns), requests (requests.csv's), events ([step, kind, request, reason]), frames (each
// recorded step's batch and pool runs [start, length, owner, state, KV group when > 0]) and the
// block size.
// A results folder is shared between people, so everything read is untrusted: it is checked
// (checkData) before anything is drawn, every string reaches the page as text (no markup is
// ever built from data), and each frame's work is bounded by the pool's size. A
// Content-Security-Policy in the page runs only its own scripts.
(function () {
  "use strict";

  const STATES = ["used", "shared", "copied", "reserved", "slack", "cached"];
  const STATE_TEXT = {
    used: "live KV", shared: "shared (prefix / fork)", copied: "copied on write",
    reserved: "reserved, unused", slack: "last block's slack", cached: "cached, free",
    free: "free",
  };
  const MOST_CELLS = 8192;  // pool map cells; a bigger pool puts several slots in a cell
  const MOST_LANES = 120;   // request lanes drawn; more are sampled evenly
  const MOST_RUNS = 64;     // runs in one page
  const MOST_SLOTS = 2 ** 40;  // a pool's capacity, in slots
  const MOST_BLOCK = 4096;     // a block's size, in slots, as drawn

  const dataElement = document.getElementById("kvlab-data");
  const LIVE = dataElement.dataset.live === "true";
  let data = null;
  const ui = {
    runA: document.getElementById("run-a"), runB: document.getElementById("run-b"),
    clock: document.getElementById("clock"), label: document.getElementById("clock-label"),
    play: document.getElementById("play"), speed: document.getElementById("speed"),
    back: document.getElementById("back"), forward: document.getElementById("forward"),
    panels: document.getElementById("panels"), note: document.getElementById("note"),
  };
  let panels = [];
  let time = 0;
  let playing = null;

  // ---- colours --------------------------------------------------------------------------
  function hue(owner) { return (owner * 137.508) % 360; }
  function ownerColor(owner, light) {
    if (owner < 0) return "#9bb";
    return "hsl(" + hue(owner).toFixed(0) + ",65%," + (light || 48) + "%)";
  }
  function cellColor(state, owner) {
    switch (state) {
      case "used": return ownerColor(owner, 50);
      case "shared": return ownerColor(owner, 30);
      case "copied": return ownerColor(owner, 50);
      case "reserved": return ownerColor(owner, 88);
      case "slack": return ownerColor(owner, 76);
      case "cached": return "#8fb3b0";
      default: return "#ececec";
    }
  }

  // ---- per-run indexes --------------------------------------------------------------------
  function prepare(run) {
    const s = run.steps;
    run.stepCount = s.step.length;
    run.end = run.stepCount ? s.t[run.stepCount - 1] + s.dur[run.stepCount - 1] : 0;
    run.eventsByStep = new Map();
    for (const e of run.events) {
      if (!run.eventsByStep.has(e[0])) run.eventsByStep.set(e[0], []);
      run.eventsByStep.get(e[0]).push(e);
    }
    run.frameSteps = run.frames.map((f) => f.step);
    run.stride = run.frames.length > 1 ? run.frames[1].step - run.frames[0].step : 1;
    run.preempted = preemptedSpans(run);
    const r = run.requests;
    run.requestCount = r.id.length;
    run.requestIndex = new Map();
    for (let i = 0; i < r.id.length; ++i) run.requestIndex.set(r.id[i], i);
    return run;
  }

  // Each request's preempted spans in time: a preempt or swap out, to its next admit or swap in.
  function preemptedSpans(run) {
    const spans = new Map();
    const open = new Map();
    const stepTime = (step) => {
      const i = lastAtMost(run.steps.step, step);
      return i < 0 ? 0 : run.steps.t[i];
    };
    for (const e of run.events) {
      const [step, kind, request] = e;
      if (kind === "preempt" || kind === "swap_out") open.set(request, stepTime(step));
      if ((kind === "admit" || kind === "swap_in") && open.has(request)) {
        if (!spans.has(request)) spans.set(request, []);
        spans.get(request).push([open.get(request), stepTime(step)]);
        open.delete(request);
      }
    }
    return spans;
  }

  // The index of the last element <= value in an ascending array, or -1.
  function lastAtMost(array, value) {
    let lo = 0, hi = array.length - 1, found = -1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (array[mid] <= value) { found = mid; lo = mid + 1; } else hi = mid - 1;
    }
    return found;
  }

  // ---- checking the data -------------------------------------------------------------------
  // The data as the page needs it, or an Error saying what is wrong. Wrong or absurd parts are
  // dropped with a note (problems) where the rest still draws: a frame, an event, a run.
  const STEP_KEYS = ["step", "t", "dur", "batch", "prefill", "decode", "preempted", "waiting",
    "running", "capacity", "used", "reserved", "slack", "free", "cached", "padding"];
  const REQUEST_NUMBERS = ["id", "arrival", "scheduled", "first_token", "finish", "prompt",
    "output", "ttft", "tpot", "preemptions", "rejected"];
  const isNumber = (v) => typeof v === "number" && Number.isFinite(v);
  const isCount = (v) => Number.isSafeInteger(v) && v >= 0;
  const text = (v) => (typeof v === "string" ? v : v === undefined || v === null ? "" : String(v));

  function checkData(raw, problems) {
    if (raw === null || typeof raw !== "object" || !Array.isArray(raw.runs))
      throw new Error("the data is not kvlab view's (an object with a list of runs)");
    const runs = [];
    for (const [k, run] of raw.runs.slice(0, MOST_RUNS).entries()) {
      try { runs.push(checkRun(run, problems)); } catch (error) {
        problems.push("run " + (k + 1) + " left out: " + error.message);
      }
    }
    if (raw.runs.length > MOST_RUNS) problems.push("only the first " + MOST_RUNS + " runs drawn");
    if (!runs.length) throw new Error("no run could be drawn");
    return { title: text(raw.title), experiment_file: text(raw.experiment_file), runs };
  }

  function checkRun(run, problems) {
    if (run === null || typeof run !== "object") throw new Error("not an object");
    const name = text(run.name);
    const s = run.steps;
    if (s === null || typeof s !== "object" || !Array.isArray(s.step)) throw new Error("no steps");
    const n = s.step.length;
    const steps = {};
    const withheld = [];
    for (const key of STEP_KEYS) {
      const column = s[key];
      if (column === undefined) { withheld.push(key); steps[key] = new Array(n).fill(null); continue; }
      const essential = key === "step" || key === "t" || key === "dur";  // an empty cell: null
      if (!Array.isArray(column) || column.length !== n ||
          !column.every((v) => isNumber(v) || (!essential && v === null)))
        throw new Error("steps." + key + " is not " + n + " numbers");
      steps[key] = column;
    }
    if (withheld.includes("step") || withheld.includes("t") || withheld.includes("dur"))
      throw new Error("its steps have no step, t or dur");
    const capacity = n && isCount(steps.capacity[0]) ? Math.min(steps.capacity[0], MOST_SLOTS) : 0;
    const blockSize = isCount(run.block_size) ? Math.min(run.block_size, MOST_BLOCK) : 0;
    return {
      name, steps, withheld, capacity, block_size: blockSize,
      withheldNote: text(run.withheld), summary_of: text(run.summary_of),
      summary: checkSummary(run.summary),
      requests: checkRequests(run.requests, name, problems),
      events: checkEvents(run.events, name, problems),
      frames: checkFrames(run.frames, capacity, name, problems),
    };
  }

  function checkSummary(summary) {
    if (summary === null || typeof summary !== "object") return null;
    const mean = (v) => (v && typeof v === "object" && isNumber(v.mean) ? { mean: v.mean } : undefined);
    return { ttft_s: mean(summary.ttft_s), tpot_s: mean(summary.tpot_s),
      output_tokens_per_s: isNumber(summary.output_tokens_per_s) ? summary.output_tokens_per_s : undefined };
  }

  function checkRequests(r, name, problems) {
    const empty = Object.fromEntries(REQUEST_NUMBERS.concat(["reason"]).map((k) => [k, []]));
    if (r === null || typeof r !== "object" || !Array.isArray(r.id)) return empty;
    const n = r.id.length;
    for (const key of REQUEST_NUMBERS) {
      const column = r[key];
      if (!Array.isArray(column) || column.length !== n ||
          !column.every((v) => v === null || isNumber(v))) {
        problems.push(name + ": requests." + key + " is not " + n + " numbers: no request lanes");
        return empty;
      }
    }
    const reason = Array.isArray(r.reason) && r.reason.length === n ? r.reason.map(text) :
      new Array(n).fill("");
    return Object.assign({}, ...REQUEST_NUMBERS.map((k) => ({ [k]: r[k] })), { reason });
  }

  function checkEvents(events, name, problems) {
    if (!Array.isArray(events)) return [];
    const kept = events.filter((e) => Array.isArray(e) && isNumber(e[0]) &&
      typeof e[1] === "string" && (e[2] === undefined || isNumber(e[2])))
      .map((e) => [e[0], e[1], e[2] === undefined ? -1 : e[2], text(e[3]), isNumber(e[4]) ? e[4] : -1]);
    if (kept.length < events.length)
      problems.push(name + ": " + (events.length - kept.length) + " malformed events left out");
    return kept;
  }

  // A frame whose runs are not slots of the pool in slot order (each inside it, a known state)
  // is left out, and so is one whose runs cover the pool more than 8 times over (a slot several
  // sequences hold is in each of their views when the engine draws them): drawing a frame then
  // costs a few passes over the pool's cells at most, whatever the file says.
  function checkFrame(f, capacity) {
    if (f === null || typeof f !== "object" || !isCount(f.step) || !Array.isArray(f.runs) ||
        !Array.isArray(f.batch) || f.runs.length > 2 * capacity + 16) return null;
    let start = 0, covered = 0;
    for (const r of f.runs) {
      if (!Array.isArray(r) || !isCount(r[0]) || !isCount(r[1]) || !Number.isSafeInteger(r[2]) ||
          !STATES.includes(r[3]) || (r[4] !== undefined && !isCount(r[4])) || r[0] < start ||
          r[0] + r[1] > capacity) return null;
      start = r[0];
      covered += r[1];
    }
    if (covered > 8 * capacity) return null;
    const batch = f.batch.filter((b) => Array.isArray(b) && b.slice(0, 5).every(
      (v) => v === undefined || isNumber(v))).map((b) => b.slice(0, 5));
    if (batch.length !== f.batch.length) return null;
    const tiers = Array.isArray(f.tiers) && f.tiers.length === 4 && f.tiers.every(isCount) ?
      f.tiers : [0, 0, 0, 0];
    return { step: f.step, runs: f.runs, batch, tiers };
  }

  function checkFrames(frames, capacity, name, problems) {
    if (!Array.isArray(frames)) return [];
    const kept = [];
    for (const f of frames) {
      const frame = checkFrame(f, capacity);
      if (frame && (!kept.length || frame.step > kept[kept.length - 1].step)) kept.push(frame);
    }
    if (kept.length < frames.length)
      problems.push(name + ": " + (frames.length - kept.length) + " malformed pool frames left out");
    return kept;
  }

  // What went wrong, on the page (the note under the controls).
  function showProblems(problems) {
    if (!problems.length) return;
    ui.note.classList.add("problem");
    ui.note.textContent = "kvlab view: " + problems.slice(0, 8).join("; ") +
      (problems.length > 8 ? "; and " + (problems.length - 8) + " more" : "");
  }

  // ---- building the DOM (text only) ---------------------------------------------------------
  // An element with a class and children (elements, or strings as text nodes).
  function make(tag, className, ...children) {
    const element = document.createElement(tag);
    if (className) element.className = className;
    for (const child of children)
      element.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
    return element;
  }

  // ---- panels -----------------------------------------------------------------------------
  function makePanel(run) {
    const p = {
      run, info: make("div", "step-info"), pool: make("canvas"), tiers: make("div", "tiers"),
      counts: make("div", "pool-counts"), batch: make("tbody"), events: make("ul", "events"),
      lanes: make("canvas"), lanesNote: make("div", "lanes-note"), chartCanvas: make("canvas"),
      step: -1,
    };
    p.lanes.height = 200;
    const legendBox = make("div", "legend");
    p.el = make("section", "panel", make("h2", "", run.name + summaryText(run)), p.info,
      make("div", "cols", make("div", "pool", p.pool, p.tiers, p.counts),
        make("div", "batch", make("table", "", p.batch), p.events)),
      legendBox, make("div", "lanes", p.lanesNote, p.lanes), make("div", "chart", p.chartCanvas));
    const el = p.el;
    layoutPool(p);
    legend(legendBox);
    p.chart = makeChart(p);
    p.pool.addEventListener("mousemove", (ev) => poolTooltip(p, ev));
    p.lanes.addEventListener("mousemove", (ev) => laneTooltip(p, ev));
    ui.panels.appendChild(el);
    return p;
  }

  function summaryText(run) {
    const s = run.summary;
    if (!s) return "";
    const parts = [];
    if (s.ttft_s && s.ttft_s.mean !== undefined) parts.push("TTFT " + ms(s.ttft_s.mean));
    if (s.tpot_s && s.tpot_s.mean !== undefined) parts.push("TPOT " + ms(s.tpot_s.mean));
    if (s.output_tokens_per_s !== undefined) parts.push(s.output_tokens_per_s.toFixed(1) + " tok/s");
    return parts.length ? "  (" + (run.summary_of ? run.summary_of + " " : "") + parts.join(", ") +
      ")" : "";
  }
  function ms(seconds) { return (seconds * 1e3).toFixed(seconds < 0.01 ? 2 : 1) + " ms"; }

  function legend(el) {
    for (const state of STATES.concat(["free"])) {
      const item = make("span", "", make("span", "swatch"));
      item.firstChild.style.background = cellColor(state, 200);
      if (state === "copied") item.firstChild.style.outline = "2px solid #f80";
      if (state === "shared") item.firstChild.style.outline = "1px solid #000";
      item.appendChild(document.createTextNode(STATE_TEXT[state]));
      el.appendChild(item);
    }
    const note = document.createElement("span");
    note.textContent = "(hue: the owning request)";
    el.appendChild(note);
  }

  // The pool as a grid: a row holds a whole number of blocks; a cell holds slotsPerCell slots.
  function layoutPool(p) {
    const run = p.run;
    const capacity = Math.max(1, run.capacity);
    p.slotsPerCell = Math.max(1, Math.ceil(capacity / MOST_CELLS));
    const cells = Math.ceil(capacity / p.slotsPerCell);
    const block = Math.max(1, run.block_size || 16);
    p.columns = p.slotsPerCell === 1 ? Math.min(512, block * Math.max(1, Math.round(64 / block))) : 64;
    p.rows = Math.ceil(cells / p.columns);
    p.cellSize = Math.max(2, Math.min(8, Math.floor(420 / p.columns), Math.floor(420 / p.rows)));
    p.pool.width = p.columns * p.cellSize;
    p.pool.height = p.rows * p.cellSize;
  }

  // ---- drawing a step ---------------------------------------------------------------------
  function stepAt(run, t) {
    return Math.max(0, lastAtMost(run.steps.t, t));
  }

  function show(p, index) {
    const run = p.run;
    if (!run.stepCount) { p.info.textContent = "no steps"; return; }
    const s = run.steps;
    const step = s.step[index];
    const frameIndex = lastAtMost(run.frameSteps, step);
    const frame = frameIndex >= 0 ? run.frames[frameIndex] : null;
    p.step = step;
    p.frame = frame;
    p.info.dataset.step = step;
    p.info.dataset.frameStep = frame ? frame.step : -1;
    const v = (key) => (s[key][index] === null ? "-" : s[key][index]);
    p.info.textContent =
      "step " + step + " of " + s.step[run.stepCount - 1] + " at " + ms(s.t[index]) +
      " (lasted " + ms(s.dur[index]) + "): batch " + v("batch") + ", prefill " +
      v("prefill") + " tokens, decode " + v("decode") + ", waiting " + v("waiting") +
      ", running " + v("running") + (frame && frame.step !== step ?
        "; pool and batch of step " + frame.step + " (a frame every " + run.stride + " steps)" : "");
    drawPool(p, frame);
    listBatch(p, frame);
    listEvents(p, frame ? frame.step : step);
    drawLanes(p, s.t[index]);
    p.chart.$kvlabTime = s.t[index];
    p.chart.draw();
  }

  function drawPool(p, frame) {
    const ctx = p.pool.getContext("2d");
    const cs = p.cellSize;
    ctx.fillStyle = cellColor("free");
    ctx.fillRect(0, 0, p.pool.width, p.pool.height);
    const counts = { used: 0, shared: 0, copied: 0, reserved: 0, slack: 0, cached: 0 };
    p.cells = new Array(p.rows * p.columns);
    if (!frame) {
      p.counts.textContent = p.run.withheldNote ? "withheld: " + p.run.withheldNote :
        "no frame recorded";
      p.tiers.replaceChildren();
      return;
    }
    // Each cell takes the state holding most of its slots.
    const cellState = new Map();
    for (const [start, length, owner, state, group] of frame.runs) {
      counts[state] += length;
      for (let slot = start; slot < start + length;) {
        const cell = Math.floor(slot / p.slotsPerCell);
        const cellEnd = (cell + 1) * p.slotsPerCell;
        const take = Math.min(cellEnd, start + length) - slot;
        const prev = cellState.get(cell);
        if (!prev || take > prev[2]) cellState.set(cell, [state, owner, take, group || 0]);
        slot += take;
      }
    }
    for (const [cell, [state, owner, , group]] of cellState) {
      const x = (cell % p.columns) * cs, y = Math.floor(cell / p.columns) * cs;
      ctx.fillStyle = cellColor(state, owner);
      ctx.fillRect(x, y, cs, cs);
      if (group > 0 && cs >= 4) {  // a KV group's slots: one dot a group, in the top left corner
        ctx.fillStyle = "rgba(0,0,0,0.45)";
        for (let g = 0; g < Math.min(group, Math.floor(cs / 2)); ++g)
          ctx.fillRect(x + 1 + 2 * g, y + 1, 1, 1);
      }
      if (state === "copied") {
        ctx.strokeStyle = "#f80";
        ctx.strokeRect(x + 0.5, y + 0.5, cs - 1, cs - 1);
      } else if (state === "shared" && cs >= 4) {
        ctx.fillStyle = "#fff";
        ctx.fillRect(x + cs / 2 - 0.5, y + cs / 2 - 0.5, 1, 1);
      }
      p.cells[cell] = [state, owner, group];
    }
    // Block boundaries: a faint line every block along each row.
    if (p.slotsPerCell === 1 && p.run.block_size > 1 && cs >= 4) {
      ctx.fillStyle = "rgba(255,255,255,0.7)";
      for (let c = p.run.block_size; c < p.columns; c += p.run.block_size)
        ctx.fillRect(c * cs - 0.5, 0, 1, p.pool.height);
    }
    for (const state of STATES) p.counts.dataset[state] = counts[state];
    p.counts.dataset.live = counts.used + counts.shared + counts.copied;  // steps.csv's kv_used
    p.counts.textContent = STATES.filter((st) => counts[st] > 0)
      .map((st) => STATE_TEXT[st] + " " + counts[st]).join(", ") + " of " + p.run.capacity +
      " slots" + (p.slotsPerCell > 1 ? " (a cell: " + p.slotsPerCell + " slots)" : "");
    const tiers = frame.tiers;
    p.tiers.replaceChildren();
    for (const [name, held, capacity] of [["host", tiers[0], tiers[1]], ["disk", tiers[2], tiers[3]]]) {
      if (!capacity) continue;
      const fill = make("span");
      fill.style.width = Math.min(100, 100 * held / capacity) + "%";
      p.tiers.appendChild(make("div", "", name + " tier ", make("span", "tier-bar", fill),
        " " + held + " / " + capacity + " blocks"));
    }
  }

  function listBatch(p, frame) {
    p.batch.replaceChildren();
    if (!frame) return;
    for (const [request, tokens, decode, proposals, accepted] of frame.batch) {
      const what = decode ? (proposals ? "verify " + proposals + ", accepted " + accepted : "decode")
        : "prefill " + tokens + " tokens";
      const swatch = make("span", "swatch");
      swatch.style.background = ownerColor(request);
      p.batch.appendChild(make("tr", "", make("td", "", swatch, "r" + request), make("td", "", what)));
    }
  }

  function listEvents(p, step) {
    p.events.replaceChildren();
    for (const [, kind, request, reason] of p.run.eventsByStep.get(step) || []) {
      const li = document.createElement("li");
      const who = kind === "defer" && request < 0 ? -request + " requests" :
        request >= 0 ? "r" + request : "";
      li.textContent = kind + " " + who + (reason ? ": " + reason : "");
      p.events.appendChild(li);
    }
  }

  // ---- request lanes ----------------------------------------------------------------------
  // Requests that overlap a window around t (the whole run when it is short), at most
  // MOST_LANES of them (evenly sampled): queued, prefill, decode, preempted; TTFT ticked.
  function drawLanes(p, t) {
    const run = p.run, r = run.requests;
    const span = sharedEnd();
    const whole = run.requestCount <= MOST_LANES;
    const half = whole ? span : Math.max(span / 40, 1e-6);
    const from = whole ? 0 : Math.max(0, t - half), to = whole ? span : Math.min(span, t + half);
    let picked = [];
    for (let i = 0; i < run.requestCount; ++i) {
      const end = r.finish[i] !== null ? r.finish[i] : span;
      if (r.arrival[i] <= to && end >= from) picked.push(i);
    }
    const total = picked.length;
    if (total > MOST_LANES) {
      const every = total / MOST_LANES;
      picked = Array.from({ length: MOST_LANES }, (_, k) => picked[Math.floor(k * every)]);
    }
    p.lanesNote.textContent = (whole ? "every request" : total + " requests overlap " +
      ms(from) + " to " + ms(to)) + (total > MOST_LANES ? ", " + MOST_LANES + " of them drawn" : "") +
      ": queued (grey), prefill (blue), decode (green), preempted (red), | first token";
    const canvas = p.lanes;
    const width = canvas.clientWidth || 600;
    const lane = Math.max(2, Math.min(12, Math.floor(400 / Math.max(1, picked.length))));
    canvas.width = width;
    canvas.height = Math.max(40, picked.length * lane + 14);
    const ctx = canvas.getContext("2d");
    const x = (v) => ((v - from) / (to - from || 1)) * (width - 2) + 1;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    p.laneRows = picked;
    p.laneGeometry = { lane, x, from, to };
    picked.forEach((i, row) => {
      const y = row * lane;
      const h = Math.max(1, lane - 1);
      const bar = (a, b, color) => {
        if (a === null || b === null || b < a) return;
        ctx.fillStyle = color;
        ctx.fillRect(x(a), y, Math.max(1, x(b) - x(a)), h);
      };
      const end = r.finish[i] !== null ? r.finish[i] : span;
      if (r.rejected[i]) { bar(r.arrival[i], r.arrival[i] + span / 200, "#000"); return; }
      bar(r.arrival[i], r.scheduled[i] !== null ? r.scheduled[i] : end, "#ccc");
      bar(r.scheduled[i], r.first_token[i] !== null ? r.first_token[i] : end, "#4a7bd0");
      bar(r.first_token[i], end, "#5cae5c");
      for (const [a, b] of run.preempted.get(r.id[i]) || []) bar(a, b, "#d9534f");
      if (r.first_token[i] !== null) {
        ctx.fillStyle = "#000";
        ctx.fillRect(x(r.first_token[i]), y, 1, h);
      }
    });
    ctx.fillStyle = "#d00";
    ctx.fillRect(x(t), 0, 1, canvas.height);
  }

  function laneTooltip(p, ev) {
    if (!p.laneRows) return;
    const row = Math.floor(ev.offsetY / p.laneGeometry.lane);
    const i = p.laneRows[row];
    if (i === undefined) { p.lanes.title = ""; return; }
    const r = p.run.requests;
    p.lanes.title = "request " + r.id[i] + ": prompt " + r.prompt[i] + ", output " + r.output[i] +
      (r.rejected[i] ? ", rejected: " + r.reason[i] : ", TTFT " + (r.ttft[i] === null ? "-" :
        ms(r.ttft[i])) + ", TPOT " + (r.tpot[i] === null ? "-" : ms(r.tpot[i]))) +
      (r.preemptions[i] ? ", preempted " + r.preemptions[i] + "x" : "");
  }

  function poolTooltip(p, ev) {
    const cell = Math.floor(ev.offsetY / p.cellSize) * p.columns + Math.floor(ev.offsetX / p.cellSize);
    const c = p.cells && p.cells[cell];
    const slot = cell * p.slotsPerCell;
    p.pool.title = "slot " + slot + (p.run.block_size ? " (block " +
      Math.floor(slot / p.run.block_size) + ")" : "") + ": " + (c ? STATE_TEXT[c[0]] +
      (c[1] >= 0 ? ", request " + c[1] : "") + (c[2] > 0 ? ", KV group " + c[2] : "") : "free");
  }

  // ---- the KV chart (Chart.js) ------------------------------------------------------------
  // Slots over time, stacked: used, reserved, slack, cached; the batch size on its own axis.
  // Past 1,000 points Chart.js's decimation plugin (min-max) draws it.
  function makeChart(p) {
    const s = p.run.steps;
    const series = (key) => s.t.map((t, i) => ({ x: t, y: s[key][i] }));
    const dataset = (label, key, color) => ({
      label, data: series(key), borderColor: color, backgroundColor: color, fill: true,
      pointRadius: 0, borderWidth: 1, stack: "kv", yAxisID: "slots",
    });
    const timeLine = {
      id: "kvlabTime",
      afterDatasetsDraw(chart) {
        if (chart.$kvlabTime === undefined) return;
        const x = chart.scales.x.getPixelForValue(chart.$kvlabTime);
        const ctx = chart.ctx;
        ctx.save();
        ctx.fillStyle = "#d00";
        ctx.fillRect(x, chart.chartArea.top, 1, chart.chartArea.bottom - chart.chartArea.top);
        ctx.restore();
      },
    };
    return new Chart(p.chartCanvas, {
      type: "line",
      data: {
        datasets: [
          dataset("used", "used", "rgba(70,130,180,0.8)"),
          dataset("reserved", "reserved", "rgba(240,170,60,0.6)"),
          dataset("slack", "slack", "rgba(200,120,200,0.6)"),
          dataset("cached", "cached", "rgba(143,179,176,0.6)"),
          { label: "batch", data: series("batch"), borderColor: "#333", pointRadius: 0,
            borderWidth: 1, fill: false, yAxisID: "batch" },
        ],
      },
      options: {
        animation: false, parsing: false, normalized: true, maintainAspectRatio: false,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        plugins: { decimation: { enabled: true, algorithm: "min-max", threshold: 1000 },
                   legend: { labels: { boxWidth: 10 } } },
        scales: {
          x: { type: "linear", min: 0, max: sharedEnd(), title: { display: true, text: "time (s)" } },
          slots: { stacked: true, position: "left", title: { display: true, text: "KV slots" },
                   max: p.run.capacity || undefined, beginAtZero: true },
          batch: { position: "right", grid: { drawOnChartArea: false }, beginAtZero: true,
                   title: { display: true, text: "batch" } },
        },
      },
      plugins: [timeLine],
    });
  }

  // ---- the clock --------------------------------------------------------------------------
  // One clock for the runs side by side: the lanes and charts all span the longest run.
  function sharedEnd() { return Math.max(...panels.map((q) => q.run.end), 1e-9); }

  function render() {
    for (const p of panels) show(p, stepAt(p.run, time));
    ui.label.textContent = ms(time);
    ui.clock.value = time;
  }

  function setTime(t) {
    time = Math.max(0, Math.min(t, Number(ui.clock.max)));
    render();
  }

  // Panel `k`'s step `step` (its time), which the other panel follows on the same clock.
  function setStep(k, step) {
    const run = panels[k].run;
    const i = lastAtMost(run.steps.step, step);
    if (i >= 0) setTime(run.steps.t[i]);
  }

  function rebuild() {
    for (const p of panels) if (p.chart) p.chart.destroy();
    ui.panels.replaceChildren();
    const chosen = [Number(ui.runA.value)];
    if (ui.runB.value !== "") chosen.push(Number(ui.runB.value));
    panels = [];
    for (const k of chosen) panels.push({ run: data.runs[k] });  // sharedEnd() before the charts
    panels = chosen.map((k) => makePanel(data.runs[k]));
    ui.clock.max = sharedEnd();
    render();
  }

  function togglePlay() {
    if (playing) { clearInterval(playing); playing = null; ui.play.textContent = "Play"; return; }
    ui.play.textContent = "Pause";
    const tick = 50;
    playing = setInterval(() => {
      const next = time + (tick / 1000) * Number(ui.speed.value);
      if (next >= Number(ui.clock.max) && !LIVE) togglePlay();
      setTime(next);
    }, tick);
  }

  function nudge(direction) {
    const p = panels[0];
    const i = stepAt(p.run, time) + direction;
    if (i >= 0 && i < p.run.stepCount) setTime(p.run.steps.t[i]);
  }

  function fillRunChoices() {
    const keepA = ui.runA.value, keepB = ui.runB.value;
    ui.runA.replaceChildren();
    ui.runB.replaceChildren(new Option("(none)", ""));
    data.runs.forEach((run, k) => {
      ui.runA.add(new Option(run.name, k));
      ui.runB.add(new Option(run.name, k));
    });
    ui.runA.value = keepA !== "" && keepA < data.runs.length ? keepA : 0;
    ui.runB.value = keepB !== "" && keepB < data.runs.length ? keepB :
      data.runs.length > 1 ? 1 : "";
  }

  // Live (kvlab serve's /ui): the server's steps so far, polled; the clock follows the newest.
  function poll() {
    fetch("/ui/data" + location.search).then((reply) => reply.json()).then((fresh) => {
      const atEnd = time >= Number(ui.clock.max) - 1e-9;
      const problems = [];
      data = checkData(fresh, problems);
      data.runs.forEach(prepare);
      const keep = time;
      rebuild();
      setTime(atEnd ? Number(ui.clock.max) : keep);
      showProblems(problems);
    }).catch((error) => { ui.note.textContent = "the server did not answer: " + error.message; })
      .finally(() => setTimeout(poll, 1000));
  }

  function start() {
    const problems = [];
    data = checkData(JSON.parse(dataElement.textContent), problems);
    document.getElementById("title").textContent = "kvlab view: " + data.title;
    data.runs.forEach(prepare);
    const frames = data.runs.map((run) => run.frames.length ? run.stride : 0);
    const withheld = data.runs.find((run) => run.withheldNote);
    ui.note.textContent = (data.experiment_file ? data.experiment_file + ": " : "") +
      data.runs.length + " run(s). " + (withheld ? "Withheld: " + withheld.withheldNote + "." :
        frames.some((f) => f > 1) ?
        "Long runs keep a pool frame every " + Math.max(...frames) + " steps (frames.jsonl's budget)." :
        "A pool frame for every step.") + " Drag the clock; both runs show their step at that time.";
    fillRunChoices();
    ui.runA.addEventListener("change", rebuild);
    ui.runB.addEventListener("change", rebuild);
    ui.clock.addEventListener("input", () => setTime(Number(ui.clock.value)));
    ui.play.addEventListener("click", togglePlay);
    ui.back.addEventListener("click", () => nudge(-1));
    ui.forward.addEventListener("click", () => nudge(1));
    rebuild();
    showProblems(problems);
    if (LIVE) { setTime(Number(ui.clock.max)); poll(); }
  }

  // For tests and for scripting the page from a browser's console.
  window.kvlabView = {
    setTime, setStep,
    state: () => panels.map((p) => ({
      run: p.run.name, step: p.step, frameStep: p.frame ? p.frame.step : -1,
      counts: Object.assign({}, p.counts.dataset),
    })),
    problems: () => (ui.note.classList.contains("problem") ? ui.note.textContent : ""),
  };
  try {
    start();
  } catch (error) {  // data the page cannot draw: say so, never a blank page
    showProblems([error.message]);
  }
})();
