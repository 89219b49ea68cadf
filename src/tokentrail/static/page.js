// tokentrail live confidence page.
// Streams /v1/chat/completions or /v1/completions (stream=true) with fetch + ReadableStream,
// reads the SSE events, and renders each segment of the "tokentrail" extension as a span
// shaded by its confidence. Hovering (or tapping) a span shows its tokens, their logprobs
// and the top alternatives. With a JSON output format (or "JSON fields" ticked) the
// extension's `fields` fill a table: one row per leaf value, shaded by its confidence
// level as the segments are. Picking an alternative in a pinned tooltip branches there
// (tokentrail.branch: the reply's tokens before it kept, the picked token forced); a
// low-confidence segment or field offers "retry" (a branch at its first token, sampled
// afresh). The replies form a tree (#tree) the user walks back and forth. No dependencies.
"use strict";

(function () {
  const view = window.tokentrailView;  // view.js: how tokens and their tooltip are drawn
  const { el } = view;
  const $ = (id) => document.getElementById(id);
  const output = $("output");
  const tip = $("tip");
  const status = $("status");
  let segments = [];      // segment objects from the stream, by position
  let controller = null;  // AbortController of the running request
  let pinned = null;      // span whose tooltip stays open after a tap
  // The reply tree: node 0 is the original; each branch names its parent, the position
  // it branched at and the token forced there (null: sampled afresh, a retry). Each node
  // keeps its request and what streamed (segments, fields), so walking redraws it.
  const nodes = [];
  let current = -1;       // the node shown

  // Confidence bucket of a segment or a field: the level the server computed (0..4, from
  // tokentrail.segment.CONFIDENCE_LEVELS), so the page and the CLI share one rule.
  function bucket(conf) {
    if (!conf || conf.level === null || conf.level === undefined) return "none";
    return String(conf.level);
  }

  function tokenCount() {
    const n = Number(output.dataset.tokens);
    return `${n} token${n === 1 ? "" : "s"}`;
  }

  function setStatus(text, isError) {
    status.textContent = text;
    status.classList.toggle("error", !!isError);
  }

  // When the server has an API key (serve --api-key), /v1/* answers 401 until the
  // page sends it: ask once, keep it for this tab, send it as a Bearer token.
  let apiKey = sessionStorage.getItem("tokentrail-api-key") || "";
  function authHeaders(headers) {
    return apiKey ? Object.assign({ Authorization: "Bearer " + apiKey }, headers) : headers;
  }
  function askForKey() {
    const key = window.prompt("This server needs an API key (serve --api-key):", "");
    if (key === null || key === "") return false;
    apiKey = key;
    sessionStorage.setItem("tokentrail-api-key", key);
    return true;
  }

  async function loadModels() {
    try {
      let r = await fetch("/v1/models", { headers: authHeaders({}) });
      while (r.status === 401 && askForKey()) {
        r = await fetch("/v1/models", { headers: authHeaders({}) });
      }
      const j = await r.json();
      if (!r.ok) throw new Error(j.error ? j.error.message : r.status);
      const select = $("model");
      select.textContent = "";
      for (const m of j.data) {
        const o = document.createElement("option");
        o.value = o.textContent = m.id;
        select.appendChild(o);
      }
      output.dataset.models = String(j.data.length);
    } catch (e) {
      setStatus("cannot list models: " + e, true);
    }
  }

  function numberOr(id, fallback) {
    const v = $(id).value.trim();
    return v === "" ? fallback : Number(v);
  }

  function requestBody() {
    const mode = $("mode").value;
    const top = numberOr("top", 0);
    const body = {
      model: $("model").value,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: numberOr("max-tokens", 80),
      temperature: numberOr("temperature", 0),
      top_p: numberOr("top-p", 1),
    };
    const seed = numberOr("seed", null);
    if (seed !== null) body.seed = seed;
    const stops = $("stop-strings").value.split("\n").filter((s) => s !== "");
    if (stops.length) body.stop = stops;
    const format = $("format").value;
    if (format === "json_object") body.response_format = { type: "json_object" };
    if (format === "json_schema") {
      let schema;
      try {
        schema = JSON.parse($("schema").value);
      } catch (e) {
        throw new Error("the JSON schema is not JSON: " + e.message);
      }
      body.response_format = {
        type: "json_schema", json_schema: { name: "page", schema: schema, strict: true },
      };
    }
    if ($("want-fields").checked) body.tokentrail = { fields: true };
    if (mode === "chat") {
      const system = $("system").value.trim();
      body.messages = system ? [{ role: "system", content: system }] : [];
      body.messages.push({ role: "user", content: $("prompt").value });
      body.logprobs = true;
      if (top > 0) body.top_logprobs = top;
    } else {
      body.prompt = $("prompt").value;
      body.logprobs = top;
    }
    return [mode === "chat" ? "/v1/chat/completions" : "/v1/completions", body];
  }

  function addSegment(seg) {
    segments.push(seg);
    renderSegment(seg, segments.length - 1);
  }

  function renderSegment(seg, i) {
    const span = document.createElement("span");
    span.className = seg.text === "" ? "seg empty" : "seg";
    span.dataset.segment = String(i);
    span.dataset.bucket = bucket(seg.confidence);
    const node = nodes[current];
    if (node && node.parent !== null && seg.tokens.some((t) => t.index === node.at)) {
      span.classList.add("branch-point");
    }
    span.textContent = seg.text;
    output.appendChild(span);
  }

  // -- the fields table: one row per JSON leaf, in the chunk where its last token came --

  const fieldsBox = $("fields-box");
  const fieldRows = document.querySelector("#fields tbody");

  function clearFields() {
    fieldRows.textContent = "";
    fieldsBox.dataset.fields = "0";
    fieldsBox.hidden = true;
    $("fields-error").hidden = true;
  }

  // A probability as a percentage; one too small for that in scientific notation.
  function share(p) {
    if (p === null || p === undefined) return "–";
    return p >= 0.001 || p === 0 ? (100 * p).toFixed(1) + "%" : p.toExponential(1);
  }

  function alternativesCell(field) {
    const cell = el("td", { class: "alt" });
    if (!field.alternatives) {
      cell.appendChild(el("span", { class: "part" }, field.reason ? "– " + field.reason : "–"));
      return cell;
    }
    for (const a of field.alternatives) {
      const item = el("div", { "data-alt-value": JSON.stringify(a.value) });
      item.appendChild(el("code", {}, JSON.stringify(a.value)));
      let text = " " + share(a.probability);
      if (a.normalized !== null && a.normalized !== undefined) {
        text += ` (${share(a.normalized)} of the allowed)`;
      }
      item.appendChild(document.createTextNode(text));
      cell.appendChild(item);
    }
    return cell;
  }

  function addField(field) {
    const c = field.confidence;
    const tr = el("tr", { class: "field", "data-path": field.path, "data-bucket": bucket(c) });
    const path = el("td");
    path.appendChild(el("code", {}, field.path === "" ? "(whole reply)" : field.path));
    tr.appendChild(path);
    const value = el("td", { class: "value" });
    value.appendChild(el("code", {}, field.text));  // the exact JSON text the model wrote
    tr.appendChild(value);
    const n = field.tokens.length;
    const conf = c ? `level ${c.level} · ${share(Math.exp(c.mean_logprob))}` : "–";
    const confCell = el("td", { class: "conf" }, `${conf} · ${n} token${n === 1 ? "" : "s"}`);
    if (low(c) && n && canBranch()) confCell.appendChild(retryButton(field.tokens[0].index));
    tr.appendChild(confCell);
    tr.appendChild(alternativesCell(field));
    fieldRows.appendChild(tr);
    fieldsBox.dataset.fields = String(fieldRows.children.length);
    fieldsBox.hidden = false;
  }

  function showFieldsError(reason) {
    const box = $("fields-error");
    box.textContent = "no fields: " + reason;
    box.hidden = false;
    fieldsBox.hidden = false;
  }

  function handleEvent(raw) {
    for (const line of raw.split("\n")) {
      if (!line.startsWith("data: ")) continue;
      const payload = line.slice(6);
      if (payload === "[DONE]") {
        output.dataset.state = "done";
        continue;
      }
      const chunk = JSON.parse(payload);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) {
        const u = chunk.usage;
        setStatus(`${u.completion_tokens} tokens (prompt ${u.prompt_tokens})`);
      }
      const ext = chunk.tokentrail;
      if (!ext) continue;
      if (ext.token) {
        output.dataset.tokens = String(Number(output.dataset.tokens) + 1);
        if (!chunk.usage) setStatus(`streaming… ${tokenCount()}`);
      }
      for (const seg of ext.segments) addSegment(seg);
      for (const field of ext.fields || []) {
        nodes[current].fields.push(field);
        addField(field);
      }
      if (ext.fields_error) {
        nodes[current].fieldsError = ext.fields_error;
        showFieldsError(ext.fields_error);
      }
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.finish_reason) output.dataset.finish = choice.finish_reason;
    }
  }

  async function generate(event) {
    event.preventDefault();
    if (controller) controller.abort();
    let url, body;
    try {
      [url, body] = requestBody();
    } catch (e) {
      hideTip(true);
      output.dataset.state = "error";
      setStatus(String(e.message || e), true);
      return;
    }
    nodes.length = 0;
    nodes.push(newNode(null, null, null, "original"));
    await run(url, body, 0);
  }

  function newNode(parent, at, token, label) {
    return { parent, at, token, label, segments: [], fields: [], fieldsError: null,
             url: null, body: null, tokens: "0", finish: null, state: "streaming",
             lastChild: null };
  }

  // Stream `body` to `url` into node `index` (shown while it streams).
  async function run(url, body, index) {
    hideTip(true);
    const node = nodes[index];
    node.url = url;
    node.body = body;
    showNode(index);
    output.dataset.state = "streaming";
    setStatus("waiting for the model…");
    controller = new AbortController();
    $("go").disabled = true;
    $("stop").disabled = false;
    renderTree();
    try {
      const r = await fetch(url, {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!r.ok) {
        let message = r.status + " " + r.statusText;
        try { message = (await r.json()).error.message; } catch (e) { /* not JSON */ }
        throw new Error(message);
      }
      setStatus("streaming…");
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          handleEvent(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
        }
      }
      if (output.dataset.state !== "done") throw new Error("the stream ended early");
    } catch (e) {
      if (e.name === "AbortError") {
        output.dataset.state = "stopped";
        setStatus(`stopped after ${tokenCount()}`);
      } else {
        output.dataset.state = "error";
        setStatus(String(e.message || e), true);
      }
    } finally {
      controller = null;
      $("go").disabled = false;
      $("stop").disabled = true;
      node.tokens = output.dataset.tokens;
      node.finish = output.dataset.finish || null;
      node.state = output.dataset.state;
      renderTree();
    }
  }

  // -- the reply tree: show a node, walk to its parent or child, branch from a token --

  const tree = $("tree");

  function showNode(index) {
    current = index;
    const node = nodes[index];
    const parent = node.parent === null ? null : nodes[node.parent];
    if (parent) parent.lastChild = index;
    segments = node.segments;
    output.textContent = "";
    clearFields();
    segments.forEach(renderSegment);
    for (const field of node.fields) addField(field);
    if (node.fieldsError) showFieldsError(node.fieldsError);
    output.dataset.tokens = node.tokens;
    output.dataset.node = String(index);
    output.dataset.state = node.state;
    if (node.finish) output.dataset.finish = node.finish; else delete output.dataset.finish;
    renderTree();
  }

  function subtree(index) {
    const li = el("li");
    const node = nodes[index];
    const button = el("button", { type: "button", class: "node", "data-node": index }, node.label);
    if (index === current) button.setAttribute("aria-current", "true");
    li.appendChild(button);
    const kids = [];
    nodes.forEach((n, j) => { if (n.parent === index) kids.push(j); });
    if (kids.length) li.appendChild(el("ul"));
    for (const k of kids) li.lastChild.appendChild(subtree(k));
    return li;
  }

  function renderTree() {
    tree.hidden = nodes.length < 2;
    const list = $("tree-list");
    list.textContent = "";
    if (nodes.length) list.appendChild(subtree(0));
    const node = nodes[current], busy = controller !== null;
    $("back").disabled = busy || !node || node.parent === null;
    $("forward").disabled = busy || !node || node.lastChild === null;
    for (const b of list.querySelectorAll("button")) b.disabled = busy;
  }

  function walk(index) {
    if (controller || index === null || index === undefined || !nodes[index]) return;
    hideTip(true);
    showNode(index);
    const node = nodes[index];
    setStatus(node.parent === null ? "the original reply"
      : `branch at token ${node.at} (${node.label})`);
  }

  // The reply's token ids, in order (a token split over channels is listed once).
  function replyIds(node) {
    const byIndex = new Map();
    for (const seg of node.segments) for (const t of seg.tokens) byIndex.set(t.index, t.id);
    return [...byIndex.keys()].sort((a, b) => a - b).map((i) => byIndex.get(i));
  }

  // Branch the shown reply at token `at`: force `token`, or (null) sample afresh there.
  function branch(at, token, label) {
    if (controller || current < 0) return;
    const parent = nodes[current];
    const body = JSON.parse(JSON.stringify(parent.body));
    const spec = { ids: replyIds(parent), at: at };
    if (token !== null) {
      spec.token = token;
    } else {  // a retry: sampled, and not the same draw again
      if (!(body.temperature > 0)) body.temperature = 0.8;
      delete body.seed;
    }
    body.tokentrail = Object.assign({}, body.tokentrail, { branch: spec });
    nodes.push(newNode(current, at, token, label));
    run(parent.url, body, nodes.length - 1);
  }

  // How sure is "low": the two lowest of the levels the page shades by (0 and 1, below
  // tokentrail.segment.CONFIDENCE_LEVELS[1]).
  const low = (conf) => !!conf && conf.level !== null && conf.level !== undefined && conf.level <= 1;

  // The server branches unconstrained replies only (a grammar would restart at the
  // prefix): a reply asked with a response_format offers no picks and no retry.
  function canBranch() {
    const node = nodes[current];
    return !!(node && node.body && !node.body.response_format);
  }

  function retryButton(at) {
    return el("button", { type: "button", class: "retry", "data-retry-at": at }, "retry");
  }

  // -- tooltip (its content and place: view.js) --

  function fillTip(seg) {
    tip.textContent = "";
    const retry = low(seg.confidence) && seg.tokens.length && canBranch()
      ? retryButton(seg.tokens[0].index) : null;
    for (const part of view.tipContent(seg, { picks: canBranch(), retry })) tip.appendChild(part);
  }

  function showTip(span) {
    const seg = segments[Number(span.dataset.segment)];
    if (!seg) return;
    for (const s of output.querySelectorAll(".seg.active")) s.classList.remove("active");
    span.classList.add("active");
    fillTip(seg);
    tip.hidden = false;
    // A segment wrapped over two lines has several boxes: place by the one hovered first.
    const r = span.getClientRects()[0] || span.getBoundingClientRect();
    const [x, y, side] = view.placeTip(r, tip.offsetWidth, tip.offsetHeight);
    tip.style.left = (x + window.scrollX) + "px";
    tip.style.top = (y + window.scrollY) + "px";
    tip.dataset.side = side;
  }

  function hideTip(force) {
    if (pinned && !force) return;
    pinned = null;
    tip.hidden = true;
    for (const s of output.querySelectorAll(".seg.active")) s.classList.remove("active");
  }

  output.addEventListener("mouseover", (e) => {
    const span = e.target.closest(".seg");
    if (span && !pinned) showTip(span);
  });
  output.addEventListener("mouseleave", () => hideTip(false));
  output.addEventListener("click", (e) => {  // tap: pin the tooltip; tap again to close
    const span = e.target.closest(".seg");
    if (!span) return hideTip(true);
    if (pinned === span) return hideTip(true);
    pinned = null;
    showTip(span);
    pinned = span;
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") hideTip(true); });
  tip.addEventListener("click", (e) => {
    const pick = e.target.closest(".pick");
    const retry = e.target.closest("[data-retry-at]");
    if (pick) {
      const code = pick.querySelector("code");
      const label = `#${pick.dataset.at} → ${code ? code.textContent : pick.dataset.altId}`;
      branch(Number(pick.dataset.at), Number(pick.dataset.altId), label);
    } else if (retry) {
      branch(Number(retry.dataset.retryAt), null, `#${retry.dataset.retryAt} ↻ retry`);
    }
  });
  tip.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && e.target.closest(".pick")) e.target.click();
  });
  $("fields").addEventListener("click", (e) => {
    const retry = e.target.closest("[data-retry-at]");
    if (retry) branch(Number(retry.dataset.retryAt), null, `#${retry.dataset.retryAt} ↻ retry`);
  });
  tree.addEventListener("click", (e) => {
    const b = e.target.closest("button[data-node]");
    if (b) walk(Number(b.dataset.node));
  });
  $("back").addEventListener("click", () => walk(nodes[current] && nodes[current].parent));
  $("forward").addEventListener("click", () => walk(nodes[current] && nodes[current].lastChild));

  // The completion endpoint takes no messages: the system prompt applies to chat only.
  const syncMode = () => { $("system").disabled = $("mode").value !== "chat"; };
  $("mode").addEventListener("change", syncMode);
  syncMode();
  // The schema box is for the "JSON schema" output format only.
  const syncFormat = () => { $("schema-box").hidden = $("format").value !== "json_schema"; };
  $("format").addEventListener("change", syncFormat);
  syncFormat();

  $("form").addEventListener("submit", generate);
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("form").requestSubmit();
  });
  loadModels();
})();
