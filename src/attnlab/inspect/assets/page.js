// attnlab attention page: a head view (tokens in two columns, one line per weight) and a
// model view (every layer x head as a small heatmap), drawn on canvas. No network, no
// libraries: the weights come from the JSON block above, as 8-bit integers in base64.
(function () {
  "use strict";
  const started = performance.now();
  const errors = [];
  window.addEventListener("error", (e) => errors.push(String(e.message)));
  const dataElement = document.getElementById("attn-data");
  const DATA = JSON.parse(dataElement.textContent);
  dataElement.remove(); // parsed once: the (large) text need not stay in the document
  const ROW = 18; // CSS pixels per token row in the head view
  const HEAD_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const LINE_STEPS = 16; // lines are drawn in this many opacity groups, one path each
  const DRAW_FLOOR = 0.01; // weights below this are not drawn as lines
  const MAX_LINES = 6000; // past this many, only the strongest lines are drawn (long inputs)

  function bytes(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  // --- the weights -------------------------------------------------------------------------
  // kind.dense: (layers, heads, queries, keys) uint8; or kind.topk entries per query row:
  // key indices (uint16, little-endian) and weights (uint8). Weight = byte / 255.
  function prepare(kind) {
    kind.nq = kind.queries.length;
    kind.nk = kind.keys.length;
    if (kind.dense !== null) kind.denseBytes = bytes(kind.dense);
    else {
      const raw = bytes(kind.index);
      kind.indexArr = new Uint16Array(raw.buffer, 0, raw.length / 2);
      kind.valueArr = bytes(kind.value);
    }
    kind.thumbBytes = bytes(kind.thumb);
    kind.cache = new Map();
  }

  function matrix(kind, li, hi) {
    const key = li * 10000 + hi;
    if (kind.cache.has(key)) return kind.cache.get(key);
    const n = kind.nq * kind.nk;
    const m = new Float32Array(n);
    const head = li * kind.heads.length + hi;
    if (kind.dense !== null) {
      const base = head * n;
      for (let i = 0; i < n; i++) m[i] = kind.denseBytes[base + i] / 255;
    } else {
      const k = kind.topk;
      for (let q = 0; q < kind.nq; q++) {
        const row = (head * kind.nq + q) * k;
        for (let j = 0; j < k; j++) {
          const w = kind.valueArr[row + j];
          if (w) m[q * kind.nk + kind.indexArr[row + j]] = w / 255;
        }
      }
    }
    if (kind.cache.size > 8) kind.cache.delete(kind.cache.keys().next().value);
    kind.cache.set(key, m);
    return m;
  }

  // --- head view ---------------------------------------------------------------------------
  function el(tag, attrs, parent) {
    const e = document.createElement(tag);
    Object.assign(e, attrs || {});
    if (parent) parent.appendChild(e);
    return e;
  }

  function select(label, options, parent) {
    const wrap = el("label", { textContent: label + " " }, parent);
    const s = el("select", {}, wrap);
    options.forEach(([value, text]) => el("option", { value: String(value), textContent: text }, s));
    return s;
  }

  function makePanel(kind) {
    const panel = el("div", { className: "panel" }, document.getElementById("head-view"));
    el("h2", { textContent: kind.title }, panel);
    const controls = el("div", { className: "controls" }, panel);
    const layerSel = select("Layer", kind.layers.map((l, i) => [i, String(l)]), controls);
    const headSel = select("Head",
      [["all", "all"], ...kind.heads.map((h, i) => [i, String(h)])], controls);
    el("span", { className: "hint", textContent: "hover a token: where it looks (left), what looks at it (right)" }, controls);
    const floorNote = el("div", { className: "hint" }, panel);
    const scroll = el("div", { className: "scroll" }, panel);
    const canvas = el("canvas", {}, scroll);
    const state = { kind, canvas, floorNote, layer: 0, head: 0, hover: null, draws: 0 };
    headSel.value = "0";
    layerSel.addEventListener("change", () => { state.layer = Number(layerSel.value); drawHead(state); });
    headSel.addEventListener("change", () => {
      state.head = headSel.value === "all" ? "all" : Number(headSel.value);
      drawHead(state);
    });
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect();
      const side = e.clientX - r.left < state.width / 2 ? "query" : "key";
      const index = Math.floor((e.clientY - r.top - ROW / 2) / ROW);
      const n = side === "query" ? kind.nq : kind.nk;
      const hover = index >= 0 && index < n ? { side, index } : null;
      if (JSON.stringify(hover) !== JSON.stringify(state.hover)) { state.hover = hover; drawHead(state); }
    });
    canvas.addEventListener("mouseleave", () => { state.hover = null; drawHead(state); });
    state.setSelection = (layer, head) => {
      state.layer = layer; state.head = head;
      layerSel.value = String(layer); headSel.value = String(head);
      drawHead(state);
    };
    layout(state);
    return state;
  }

  function layout(state) {
    const kind = state.kind;
    const ctx = state.canvas.getContext("2d");
    ctx.font = "13px " + getComputedStyle(document.body).fontFamily;
    const longest = (tokens) => tokens.reduce((m, t) => Math.max(m, ctx.measureText(t).width), 20);
    state.leftText = Math.min(180, longest(kind.queries)) + 8;
    state.rightText = Math.min(180, longest(kind.keys)) + 8;
    state.gap = 160;
    state.width = state.leftText + state.gap + state.rightText;
    state.height = ROW * (Math.max(kind.nq, kind.nk) + 1);
    const dpr = window.devicePixelRatio || 1;
    state.canvas.width = Math.round(state.width * dpr);
    state.canvas.height = Math.round(state.height * dpr);
    state.canvas.style.width = state.width + "px";
    state.canvas.style.height = state.height + "px";
    state.dpr = dpr;
  }

  // The smallest weight drawn: DRAW_FLOOR, raised (in steps of 1/255, the stored precision)
  // until at most MAX_LINES lines remain; a hovered token's few lines are all drawn.
  function lineFloor(state, matrices) {
    if (state.hover) return DRAW_FLOOR;
    const counts = new Uint32Array(256);
    matrices.forEach((m) => { for (let i = 0; i < m.length; i++) counts[Math.round(m[i] * 255)] += 1; });
    let level = 255, drawn = counts[255];
    while (level > Math.ceil(DRAW_FLOOR * 255) && drawn + counts[level - 1] <= MAX_LINES) {
      level -= 1;
      drawn += counts[level];
    }
    return Math.max(DRAW_FLOOR, (level - 0.5) / 255);
  }

  function drawLines(ctx, state, m, color, floor) {
    const kind = state.kind;
    const x0 = state.leftText, x1 = state.leftText + state.gap;
    const paths = [];
    for (let s = 0; s < LINE_STEPS; s++) paths.push(new Path2D());
    const hover = state.hover;
    for (let q = 0; q < kind.nq; q++) {
      if (hover && hover.side === "query" && hover.index !== q) continue;
      const y0 = ROW * (q + 1);
      for (let k = 0; k < kind.nk; k++) {
        if (hover && hover.side === "key" && hover.index !== k) continue;
        const w = m[q * kind.nk + k];
        if (w < floor) continue;
        const p = paths[Math.min(LINE_STEPS - 1, Math.floor(w * LINE_STEPS))];
        p.moveTo(x0, y0);
        p.lineTo(x1, ROW * (k + 1));
      }
    }
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    paths.forEach((p, s) => { ctx.globalAlpha = (s + 1) / LINE_STEPS; ctx.stroke(p); });
    ctx.globalAlpha = 1;
  }

  function drawTokens(ctx, state, tokens, x, align, weights) {
    ctx.textAlign = align;
    ctx.textBaseline = "middle";
    tokens.forEach((t, i) => {
      const y = ROW * (i + 1);
      if (weights) {
        ctx.fillStyle = "rgba(42, 111, 219," + Math.min(1, weights[i]) + ")";
        const w = state.leftText - 6;
        ctx.fillRect(align === "right" ? x - w : x, y - ROW / 2 + 1, w, ROW - 2);
      }
      ctx.fillStyle = "#222";
      ctx.fillText(t, x, y);
    });
  }

  function drawHead(state) {
    const kind = state.kind;
    const ctx = state.canvas.getContext("2d");
    ctx.setTransform(state.dpr, 0, 0, state.dpr, 0, 0);
    ctx.clearRect(0, 0, state.width, state.height);
    ctx.font = "13px " + getComputedStyle(document.body).fontFamily;
    const heads = state.head === "all" ? kind.heads.map((_, i) => i) : [state.head];
    const matrices = heads.map((h) => matrix(kind, state.layer, h));
    const floor = lineFloor(state, matrices);
    heads.forEach((h, i) => {
      const color = HEAD_COLORS[(state.head === "all" ? h : 0) % HEAD_COLORS.length];
      drawLines(ctx, state, matrices[i], color, floor);
    });
    state.floorNote.textContent = floor > DRAW_FLOOR
      ? "long input: lines of weight >= " + floor.toFixed(3) + " drawn (hover a token for all of its)"
      : "";
    let qWeights = null, kWeights = null;
    if (state.hover && heads.length === 1) {
      const m = matrix(kind, state.layer, heads[0]);
      if (state.hover.side === "query") {
        kWeights = Array.from({ length: kind.nk }, (_, k) => m[state.hover.index * kind.nk + k]);
      } else {
        qWeights = Array.from({ length: kind.nq }, (_, q) => m[q * kind.nk + state.hover.index]);
      }
    }
    drawTokens(ctx, state, kind.queries, state.leftText - 4, "right", qWeights);
    drawTokens(ctx, state, kind.keys, state.leftText + state.gap + 4, "left", kWeights);
    state.draws += 1;
  }

  // --- model view --------------------------------------------------------------------------
  const CELL = 64, PAD = 6, LABEL = 28;

  function drawModel(kind) {
    const canvas = document.getElementById("model-canvas");
    const nl = kind.layers.length, nh = kind.heads.length;
    const dpr = window.devicePixelRatio || 1;
    const w = LABEL + nh * (CELL + PAD), h = LABEL + nl * (CELL + PAD);
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    canvas.style.width = w + "px"; canvas.style.height = h + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.imageSmoothingEnabled = false;
    ctx.font = "12px sans-serif"; ctx.fillStyle = "#444";
    ctx.textAlign = "center"; ctx.textBaseline = "middle";
    kind.heads.forEach((head, j) => ctx.fillText("h" + head, LABEL + j * (CELL + PAD) + CELL / 2, LABEL / 2));
    kind.layers.forEach((layer, i) => ctx.fillText("L" + layer, LABEL / 2, LABEL + i * (CELL + PAD) + CELL / 2));
    const tq = kind.thumbQ, tk = kind.thumbK;
    const tile = document.createElement("canvas");
    tile.width = tk; tile.height = tq;
    const tctx = tile.getContext("2d");
    const image = tctx.createImageData(tk, tq);
    for (let i = 0; i < nl; i++) {
      for (let j = 0; j < nh; j++) {
        const base = (i * nh + j) * tq * tk;
        for (let p = 0; p < tq * tk; p++) {
          const t = kind.thumbBytes[base + p]; // white = 0, dark blue = 1
          image.data[4 * p] = 255 - t * 0.9;
          image.data[4 * p + 1] = 255 - t * 0.65;
          image.data[4 * p + 2] = 255 - t * 0.2;
          image.data[4 * p + 3] = 255;
        }
        tctx.putImageData(image, 0, 0);
        ctx.drawImage(tile, LABEL + j * (CELL + PAD), LABEL + i * (CELL + PAD), CELL, CELL);
      }
    }
    modelState.draws += 1;
    modelState.kind = kind;
  }

  // --- the page ----------------------------------------------------------------------------
  const modelState = { draws: 0, kind: null };
  const panels = {};

  function showView(name) {
    document.getElementById("head-view").hidden = name !== "head";
    document.getElementById("model-view").hidden = name !== "model";
    document.getElementById("show-head").classList.toggle("active", name === "head");
    document.getElementById("show-model").classList.toggle("active", name === "model");
  }

  function notes() {
    const list = document.getElementById("notes");
    DATA.notes.forEach((n) => el("li", { textContent: n }, list));
    DATA.warnings.forEach((n) => el("li", { textContent: n, className: "warning" }, list));
  }

  function checksum(canvas) {
    // Read through a copy made for reading, so the drawing canvas stays on its fast path.
    const copy = document.createElement("canvas");
    copy.width = canvas.width; copy.height = canvas.height;
    const cctx = copy.getContext("2d", { willReadFrequently: true });
    cctx.drawImage(canvas, 0, 0);
    const px = cctx.getImageData(0, 0, canvas.width, canvas.height).data;
    let hash = 2166136261, ink = 0;
    for (let i = 0; i < px.length; i += 4) {
      if (px[i + 3]) ink += 1;
      hash = Math.imul(hash ^ (px[i] + 3 * px[i + 1] + 7 * px[i + 2] + 11 * px[i + 3] + i), 16777619);
    }
    return { hash: hash >>> 0, ink };
  }

  // The test hook (address #selftest): works the controls as a person would, for each kind
  // switches layer and head through its <select>s and records the drawing before and after,
  // clicks a model-view cell, and writes what it saw into <pre id="attnlab-selftest">.
  function change(selectEl, value) {
    selectEl.value = String(value);
    selectEl.dispatchEvent(new Event("change"));
  }

  function selfTest() {
    const testStart = performance.now();
    const kinds = DATA.kinds.map((kind) => {
      const state = panels[kind.name];
      const [layerSel, headSel] = state.canvas.closest(".panel").querySelectorAll("select");
      const before = checksum(state.canvas);
      const layer = kind.layers.length - 1, head = kind.heads.length - 1;
      change(layerSel, layer);
      change(headSel, head);
      const after = checksum(state.canvas);
      change(headSel, "all");
      const all = checksum(state.canvas);
      change(layerSel, 0);
      change(headSel, 0);
      return { name: kind.name, before, after, all, selected: [state.layer, state.head],
        changed: before.hash !== after.hash, draws: state.draws };
    });
    const model = document.getElementById("model-canvas");
    const modelInk = checksum(model);
    const last = DATA.kinds[DATA.kinds.length - 1];
    change(document.getElementById("model-kind"), last.name);
    showView("model");
    const r = model.getBoundingClientRect();
    const cell = { clientX: r.left + LABEL + (CELL + PAD) * (last.heads.length - 1) + 5,
      clientY: r.top + LABEL + (CELL + PAD) * (last.layers.length - 1) + 5, bubbles: true };
    model.dispatchEvent(new MouseEvent("click", cell));
    const opened = panels[last.name];
    const out = document.getElementById("attnlab-selftest");
    out.textContent = JSON.stringify({
      errors, renderMs: window.attnlab.renderMs, loadMs: window.attnlab.loadMs, kinds,
      model: modelInk, modelDraws: modelState.draws, clicked: [opened.layer, opened.head],
      headViewShown: !document.getElementById("head-view").hidden,
      warnings: DATA.warnings, selfTestMs: performance.now() - testStart,
    });
  }

  function main() {
    notes();
    DATA.kinds.forEach((kind) => { prepare(kind); panels[kind.name] = makePanel(kind); });
    const kindSel = document.getElementById("model-kind");
    DATA.kinds.forEach((k) => el("option", { value: k.name, textContent: k.title }, kindSel));
    kindSel.addEventListener("change", () => drawModel(DATA.kinds.find((k) => k.name === kindSel.value)));
    document.getElementById("model-canvas").addEventListener("click", (e) => {
      const r = e.currentTarget.getBoundingClientRect();
      const j = Math.floor((e.clientX - r.left - LABEL) / (CELL + PAD));
      const i = Math.floor((e.clientY - r.top - LABEL) / (CELL + PAD));
      const kind = modelState.kind;
      if (i < 0 || j < 0 || i >= kind.layers.length || j >= kind.heads.length) return;
      panels[kind.name].setSelection(i, j);
      showView("head");
    });
    document.getElementById("show-head").addEventListener("click", () => showView("head"));
    document.getElementById("show-model").addEventListener("click", () => showView("model"));
    const params = new URLSearchParams(location.hash.slice(1));
    const first = DATA.kinds.find((k) => k.name === params.get("kind")) || DATA.kinds[0];
    kindSel.value = first.name;
    const firstLayer = params.get("layer") || DATA.first.layer || 0;
    const firstHead = params.get("head") || DATA.first.head || 0;
    DATA.kinds.forEach((k) => {
      const layer = Math.min(Number(firstLayer) || 0, k.layers.length - 1);
      const head = firstHead === "all" ? "all" : Math.min(Number(firstHead) || 0, k.heads.length - 1);
      panels[k.name].setSelection(layer, head);
    });
    drawModel(first);
    showView(params.get("view") === "model" ? "model" : "head");
    // renderMs: from this script's start; loadMs: from the navigation (file read, HTML parse).
    const now = performance.now();
    window.attnlab = { ready: true, errors, renderMs: now - started, loadMs: now, panels, checksum };
    if (params.has("selftest")) selfTest();
  }

  try {
    main();
  } catch (e) {
    errors.push(String((e && e.stack) || e));
    document.getElementById("attnlab-selftest").textContent = JSON.stringify({ errors });
    throw e;
  }
})();
