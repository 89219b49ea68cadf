// tokentrail live confidence page: how a segment's tokens are drawn (page.js streams,
// keeps the state and handles events). The tooltip's content (a head line with the
// segment's confidence, then one row per token: its text, or its bytes where they are
// not valid UTF-8 alone, logprob, probability and alternatives) and where it goes.
// No dependencies; exposed as window.tokentrailView.
(function () {
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  const show = (s) => JSON.stringify(s);
  // A token that is not valid UTF-8 on its own shows as U+FFFD: give its real bytes too.
  const hex = (bytes) => bytes.map((b) => b.toString(16).toUpperCase().padStart(2, "0")).join(" ");
  function tokenCode(text, bytes) {
    const code = el("code", {}, show(text));
    if (text.includes("\ufffd") && bytes && bytes.length) code.title = "bytes " + hex(bytes);
    const wrap = el("span");
    wrap.appendChild(code);
    if (text.includes("\ufffd") && bytes && bytes.length) {
      wrap.appendChild(el("span", { class: "part" }, " [" + hex(bytes) + "]"));
    }
    return wrap;
  }
  // An alternative: what choosing it would have shown (`display`: a character it
  // completes, <0xC3> for a byte of none), its raw bytes beside a completed character.
  function altCode(a) {
    const shown = a.display ?? a.text;
    const code = el("code", {}, show(shown));
    const wrap = el("span");
    wrap.appendChild(code);
    if (a.bytes && a.bytes.length && a.text.includes("\ufffd")) {
      code.title = "bytes " + hex(a.bytes);
      wrap.appendChild(el("span", { class: "part" }, " [" + hex(a.bytes) + "]"));
    }
    return wrap;
  }
  const pct = (lp) => (100 * Math.exp(lp)).toFixed(1) + "%";
  const fmt = (lp) => (lp === null || lp === undefined ? "–" : lp.toFixed(3));

  // The tooltip's parts for `seg`: [head, table]. opts.picks: other alternatives are
  // offered as branch points (class "pick"); opts.retry: a button put in the head.
  function tipContent(seg, opts) {
    const c = seg.confidence;
    const head = el("div", { class: "head" });
    head.appendChild(el("b", {}, show(seg.text)));
    if (c) {
      head.appendChild(document.createTextNode(
        ` · ${seg.tokens.length} token${seg.tokens.length === 1 ? "" : "s"}` +
        ` · mean logprob ${fmt(c.mean_logprob)} (${pct(c.mean_logprob)})` +
        ` · min ${fmt(c.min_logprob)}` +
        (c.entropy === null ? "" : ` · entropy ${c.entropy.toFixed(3)}`)));
    }
    if (opts.retry) {
      head.appendChild(document.createTextNode(" "));
      head.appendChild(opts.retry);
    }
    const table = el("table");
    const hr = el("tr");
    for (const h of ["#", "token", "logprob", "p", "alternatives"]) hr.appendChild(el("th", {}, h));
    table.appendChild(hr);
    for (const t of seg.tokens) {
      const tr = el("tr", { "data-token-index": t.index, "data-token-id": t.id });
      tr.appendChild(el("td", { class: "num" }, String(t.index)));
      const cell = el("td");
      cell.appendChild(tokenCode(t.text, t.bytes));
      if (t.end - t.start !== t.bytes.length) {
        cell.appendChild(el("span", { class: "part" },
          ` bytes ${t.start}–${t.end} of ${t.bytes.length}`));
      }
      tr.appendChild(cell);
      tr.appendChild(el("td", { class: "num logprob" }, fmt(t.logprob)));
      tr.appendChild(el("td", { class: "num" }, t.logprob === null ? "–" : pct(t.logprob)));
      const alts = el("td", { class: "alt" });
      for (const a of t.top_logprobs || []) {
        // Another token than the one taken: pick it to branch here.
        const attrs = { "data-alt-id": a.id };
        if (a.id !== t.id && opts.picks) {
          Object.assign(attrs, { class: "pick", role: "button", tabindex: "0",
                                 "data-at": t.index, title: "branch here with this token" });
        }
        const item = el("div", attrs);
        item.appendChild(altCode(a));
        item.appendChild(document.createTextNode(` ${fmt(a.logprob)} (${pct(a.logprob)})`));
        alts.appendChild(item);
      }
      tr.appendChild(alts);
      table.appendChild(tr);
    }
    return [head, table];
  }

  // Where the tooltip goes, in viewport coordinates: above the segment when it fits
  // (the text below, which the reader reads next, stays visible), else beside it, else
  // below; always clamped inside the viewport.
  function placeTip(r, w, h) {
    const vw = document.documentElement.clientWidth;
    const vh = document.documentElement.clientHeight;
    const gap = 6;
    const clampX = (x) => Math.max(4, Math.min(x, vw - w - 4));
    const clampY = (y) => Math.max(4, Math.min(y, vh - h - 4));
    if (r.top - gap - h >= 4) return [clampX(r.left), r.top - gap - h, "above"];
    if (r.right + gap + w <= vw - 4) return [r.right + gap, clampY(r.top), "right"];
    if (r.left - gap - w >= 4) return [r.left - gap - w, clampY(r.top), "left"];
    return [clampX(r.left), clampY(r.bottom + gap), "below"];
  }

  window.tokentrailView = { el, tipContent, placeTip };
})();
