// kvserve's live KV page: first paints from one GET /kv/state (no placeholder numbers: the page
// stays hidden until then), then draws the documents received over /kv/events (server-sent
// events), falling back to polling /kv/state. No dependencies; all text goes in as text.
// body[data-seq-no]: the last streamed (or polled) document's seq_no; body[data-painted]: set
// at the first paint, whatever its source.
"use strict";
(function () {
  const SVGNS = "http://www.w3.org/2000/svg";
  const params = new URLSearchParams(location.search);
  const key = params.get("key");
  const q = key ? "?key=" + encodeURIComponent(key) : "";
  const every = params.get("interval");  // seconds between updates (0.1..10; server: 0.5)
  const $ = (id) => document.getElementById(id);
  let prev = null;
  let rects = [];

  function el(tag, attrs, text) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4))
                                     : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = String(text);
    return e;
  }
  const fmtBytes = (n) => n >= 2 ** 30 ? (n / 2 ** 30).toFixed(2) + " GiB"
    : n >= 2 ** 20 ? (n / 2 ** 20).toFixed(1) + " MiB" : n >= 1024 ? (n / 1024).toFixed(1) + " KiB"
    : n + " B";
  const pct = (x) => x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";

  function stackedBar(t) {
    const svg = el("svg:svg", {class: "bar", viewBox: "0 0 220 12", preserveAspectRatio: "none"});
    let x = 0;
    for (const [cls, n] of [["u", t.used], ["c", t.cached_free], ["f", t.free]]) {
      const w = t.num_blocks ? 220 * n / t.num_blocks : 0;
      svg.appendChild(el("svg:rect", {class: cls, x: x, y: 0, width: w, height: 12}));
      x += w;
    }
    return svg;
  }

  function drawTiers(doc) {
    const body = $("tiers").tBodies[0];
    body.replaceChildren();
    for (const t of doc.tiers) {
      const tr = el("tr", {id: "tier-" + t.name});
      for (const [f, v] of [["name", t.name], ["num_blocks", t.num_blocks], ["free", t.free],
                            ["cached_free", t.cached_free], ["used", t.used],
                            ["cached", t.cached]]) {
        tr.appendChild(el("td", {"data-field": f}, v));
      }
      const td = el("td");
      td.appendChild(stackedBar(t));
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  function drawGrid(doc) {
    const blocks = doc.blocks, n = blocks.length, svg = $("grid");
    const cols = Math.max(16, Math.min(64, Math.ceil(Math.sqrt(n * 3))));
    const size = n > 4096 ? 6 : 11, gap = 1;
    if (rects.length !== n) {
      svg.replaceChildren();
      rects = [];
      const rows = Math.ceil(n / cols);
      svg.setAttribute("width", cols * (size + gap));
      svg.setAttribute("height", rows * (size + gap));
      for (let i = 0; i < n; i++) {
        const r = el("svg:rect", {x: (i % cols) * (size + gap),
                                  y: Math.floor(i / cols) * (size + gap),
                                  width: size, height: size, rx: 1});
        r.appendChild(el("svg:title", {}, "block " + i));
        svg.appendChild(r);
        rects.push(r);
      }
    }
    const counts = {f: 0, c: 0, u: 0, s: 0};
    for (let i = 0; i < n; i++) {
      const s = blocks[i];
      counts[s] = (counts[s] || 0) + 1;
      if (rects[i].getAttribute("class") !== s) rects[i].setAttribute("class", s);
    }
    for (const s of Object.keys(counts)) $("count-" + s).textContent = counts[s];
  }

  function drawRequests(doc) {
    const body = $("requests").tBodies[0];
    body.replaceChildren();
    $("num-requests").textContent = doc.requests.length;
    $("no-requests").hidden = doc.requests.length > 0;
    $("requests").hidden = doc.requests.length === 0;
    for (const r of doc.requests) {
      const tr = el("tr", {"data-seq": r.seq_id});
      tr.appendChild(el("td", {}, r.seq_id + (r.swapped ? " (swapped out)" : "")));
      tr.appendChild(el("td", {}, r.num_tokens));
      tr.appendChild(el("td", {}, r.num_computed_tokens));
      tr.appendChild(el("td", {"data-field": "num_blocks"}, r.num_blocks));
      tr.appendChild(el("td", {"data-field": "shared_tokens"},
                        r.num_shared_blocks ? r.num_shared_blocks + " blocks (" +
                        r.shared_tokens + " tokens)" : "–"));
      tr.appendChild(el("td", {}, r.num_cached_tokens ? r.num_cached_tokens + " tokens" : "–"));
      // hybrid KV layouts: one table per group ("g0: …  g1: …"); released window blocks "·"
      const tables = r.groups && r.groups.length ? r.groups : [{group: null, block_ids: r.block_ids}];
      const ids = tables.map((g) => (g.group === null ? "" : "g" + g.group + ": ") +
        g.block_ids.slice(0, 24).map((b) => b < 0 ? "·" : b).join(" ") +
        (g.block_ids.length > 24 ? " …" : "")).join("  ");
      tr.appendChild(el("td", {class: "ids"}, ids));
      body.appendChild(tr);
    }
  }

  function drawPrefixes(doc) {
    const p = doc.prefix_cache;
    $("hit-rate").textContent = doc.prefix_caching ? pct(p.hit_rate) : "off";
    $("hits").textContent = p.hits_tokens;
    $("queries").textContent = p.queries_tokens;
    const list = $("prefixes");
    list.replaceChildren();
    for (const t of p.top) {
      const li = el("li", {class: "prefix"});
      li.appendChild(el("span", {class: "prefix-len"},
                        t.num_tokens + " tokens, " + t.num_requests + " requests: "));
      li.appendChild(el("span", {class: "prefix-text"}, t.text));
      list.appendChild(li);
    }
  }

  function logEvents(doc) {
    const c = doc.counters;
    for (const k of Object.keys(c)) $("c-" + k).textContent = c[k];
    if (!prev) return;
    const when = new Date(doc.time * 1000).toLocaleTimeString();
    const lines = [];
    for (const k of Object.keys(c)) {
      const d = c[k] - prev.counters[k];
      if (d > 0) lines.push(d + " " + k.replace("_", " "));
    }
    const before = new Set(prev.requests.map((r) => r.seq_id));
    const now = new Set(doc.requests.map((r) => r.seq_id));
    for (const r of doc.requests) {
      if (!before.has(r.seq_id)) {
        lines.push("+ " + r.seq_id + (r.num_cached_tokens ? " (prefix hit " +
                   r.num_cached_tokens + " tokens)" : ""));
      }
    }
    for (const s of before) if (!now.has(s)) lines.push("- " + s + " ended");
    const ul = $("events");
    for (const line of lines) {
      ul.insertBefore(el("li", {}, when + "  " + line), ul.firstChild);
    }
    while (ul.childElementCount > 200) ul.lastChild.remove();
  }

  function drawMath(doc) {
    const a = doc.arithmetic;
    $("formula").textContent = a.formula + "; " + fmtBytes(a.bytes_per_block) + " per block of " +
      doc.block_size + " tokens";
    $("max-len").textContent = a.max_model_len;
    $("max-len-bytes").textContent = fmtBytes(a.bytes_per_max_len_seq);
    $("kv-groups").textContent = (doc.kv_groups || []).length ? "KV groups (one block table " +
      "each, one shared pool): " + doc.kv_groups.map((g) => "g" + g.group + " " + g.num_layers +
      " layers, " + (g.window === null ? "full attention" : "window " + g.window)).join("; ") : "";
    $("live-tokens").textContent = a.live_tokens;
    $("reserved-tokens").textContent = a.reserved_tokens;
    $("live-fraction").textContent = a.live_fraction === null || a.live_fraction === undefined
      ? "idle" : pct(a.live_fraction);
  }

  function draw(doc, streamed) {
    if (!document.body.dataset.painted) {
      $("loading").remove();
      $("main").hidden = false;
      document.body.dataset.painted = streamed ? "stream" : "state";
    }
    drawTiers(doc);
    drawGrid(doc);
    drawRequests(doc);
    drawPrefixes(doc);
    logEvents(doc);
    drawMath(doc);
    prev = doc;
    if (streamed) document.body.dataset.seqNo = doc.seq_no;
  }

  function status(text, cls) {
    const c = $("conn");
    c.textContent = text;
    c.className = "conn " + cls;
  }

  async function poll() {
    try {
      const r = await fetch("kv/state" + q, {cache: "no-store"});
      if (r.ok) { draw(await r.json(), true); status("polling", "live"); }
      else status("HTTP " + r.status, "down");
    } catch (e) { status("unreachable", "down"); }
    setTimeout(poll, 2000);
  }

  let streaming = false;

  async function firstPaint() {
    try {
      const r = await fetch("kv/state" + q, {cache: "no-store"});
      if (!r.ok) { status("HTTP " + r.status + " from /kv/state", "down"); return; }
      const doc = await r.json();
      if (!streaming) {  // a streamed document may have come first: it is newer
        draw(doc, false);
        status("connecting to the live stream…", "");
      }
    } catch (e) { status("unreachable", "down"); }
  }

  $("state-link").href = "kv/state" + q;
  firstPaint();
  if (window.EventSource) {
    const eq = every ? (q ? q + "&" : "?") + "interval=" + encodeURIComponent(every) : q;
    const es = new EventSource("kv/events" + eq);
    es.addEventListener("state", (e) => {
      streaming = true;
      draw(JSON.parse(e.data), true);
      status("live", "live");
    });
    es.addEventListener("error", () => {
      if (es.readyState === EventSource.CLOSED) { status("stream closed: polling", "down"); poll(); }
      else status("reconnecting…", "down");
    });
  } else {
    poll();
  }
})();
