// Elesium audit console: the tree, step by step (arrow keys on a recorded call) and the live view.
// No framework. Untrusted text goes in through textContent; a step's tree is the server's own
// rendering of it (escaped by its templates), inserted as it came.
"use strict";
(function () {
  // Recorded view: the arrow keys follow the Previous / Next links.
  if (document.getElementById("tree-view")) {
    document.addEventListener("keydown", function (ev) {
      if (ev.target && /INPUT|TEXTAREA|SELECT/.test(ev.target.tagName)) return;
      const id = ev.key === "ArrowLeft" ? "step-prev" : ev.key === "ArrowRight" ? "step-next" : null;
      const link = id && document.getElementById(id);
      if (link) link.click();
    });
  }

  const live = document.getElementById("live");
  const form = document.getElementById("live-form");
  if (!live || !form) return;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const status = document.getElementById("live-status");
  const answer = document.getElementById("live-answer");
  const holder = document.getElementById("live-step");
  const nav = document.getElementById("live-nav");
  const pos = document.getElementById("live-pos");
  const follow = document.getElementById("live-follow");
  const start = document.getElementById("live-start");
  let steps = [];
  let at = -1;

  function show(i) {
    if (i < 0 || i >= steps.length) return;
    at = i;
    const tpl = document.createElement("template");
    tpl.innerHTML = steps[i];  // server-rendered, escaped fragment
    holder.replaceChildren(tpl.content);
    pos.textContent = "step " + (i + 1) + " of " + steps.length;
    nav.hidden = false;
  }

  function token(t, depth) {
    const span = document.createElement("span");
    span.className = "tok d" + depth;
    span.title = "token " + t.id + (depth ? ", accepted draft at depth " + depth : ", the base model's");
    span.textContent = t.text;
    answer.appendChild(span);
  }

  function handle(kind, data) {
    if (kind === "start") {
      token(data, 0);
      status.textContent = "prefill done; drafting…";
    } else if (kind === "step") {
      steps.push(data.html);
      data.tokens.forEach(function (t) { token(t, t.depth); });
      status.textContent = "step " + steps.length + " verified · τ so far " + data.tau.toFixed(2);
      if (follow.checked || at < 0) show(steps.length - 1); else pos.textContent = "step " + (at + 1) + " of " + steps.length;
    } else if (kind === "done") {
      status.textContent = "done: " + data.tokens + " tokens in " + data.steps + " steps · τ " + data.tau.toFixed(2) +
        " · " + data.finish_reason + " · seed " + data.seed;
      status.classList.add("ok");
      live.dataset.state = "done";
    } else if (kind === "error") {
      status.textContent = "error: " + data.detail;
      status.classList.add("bad");
      live.dataset.state = "error";
    }
  }

  document.getElementById("live-prev").addEventListener("click", function () { follow.checked = false; show(at - 1); });
  document.getElementById("live-next").addEventListener("click", function () { show(at + 1); });

  form.addEventListener("submit", async function (ev) {
    ev.preventDefault();
    steps = []; at = -1;
    answer.replaceChildren(); holder.replaceChildren();
    nav.hidden = true;
    status.classList.remove("ok", "bad");
    status.textContent = "waiting for the engine…";
    live.dataset.state = "running";
    start.disabled = true;
    const body = {
      prompt: document.getElementById("live-prompt").value,
      max_tokens: parseInt(document.getElementById("live-max").value, 10),
      temperature: parseFloat(document.getElementById("live-temp").value),
    };
    try {
      const r = await fetch("/console/api/live", {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf, "Accept": "text/event-stream" },
        body: JSON.stringify(body),
      });
      if (!r.ok) {
        let detail = r.statusText;
        try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
        handle("error", { detail: detail });
        return;
      }
      // Server-sent events over a POST: blocks separated by a blank line, "event:" and "data:" lines.
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          let kind = "message", data = "";
          block.split("\n").forEach(function (line) {
            if (line.startsWith("event: ")) kind = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          });
          if (data) handle(kind, JSON.parse(data));
        }
      }
    } catch (e) {
      handle("error", { detail: String(e) });
    } finally {
      start.disabled = false;
    }
  });
})();
