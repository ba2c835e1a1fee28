// Elesium audit console: the run page's actions. No framework; untrusted text only via textContent.
"use strict";
(function () {
  const root = document.getElementById("run");
  if (!root) return;
  const api = root.dataset.api;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;

  function show(el, text, cls) {
    el.textContent = text;
    el.classList.remove("ok", "bad");
    if (cls) el.classList.add(cls);
  }

  async function call(method, path, body) {
    const init = { method: method, credentials: "same-origin", headers: { "Accept": "application/json" } };
    if (method !== "GET") {
      init.headers["Content-Type"] = "application/json";
      init.headers["X-CSRF-Token"] = csrf;
      init.body = JSON.stringify(body || {});
    }
    const r = await fetch(api + path, init);
    let data = {};
    try { data = await r.json(); } catch (e) { data = { detail: r.statusText }; }
    return { status: r.status, data: data };
  }

  // The audit chain's verdict (the server's /audit route; some servers do not have it).
  const audit = document.getElementById("audit-status");
  call("GET", "/audit").then(function (res) {
    const d = res.data;
    if (res.status >= 400) { show(audit, "audit check failed: " + (d.detail || res.status), "bad"); return; }
    if (!d.available) { show(audit, "Audit chain verification is not available on this server.", null); return; }
    const v = d.verdict || {};
    let text = (v.ok ? "verified" : "BROKEN") + ": " + v.entries + " chain entries" +
      (v.records != null ? " over " + v.records + " records" : "") +
      (v.sealed ? ", sealed" : ", not sealed") +
      (v.signed ? (v.signature_ok ? ", signature valid" : ", SIGNATURE INVALID") : ", unsigned");
    if (v.first_bad) {
      text += "\nfirst bad entry: #" + v.first_bad.seq + " (" + v.first_bad.kind + " " + v.first_bad.ref + "): " + v.first_bad.reason;
    }
    show(audit, text, v.ok ? "ok" : "bad");
  }).catch(function (e) { show(audit, "audit check failed: " + e, "bad"); });

  const replay = document.getElementById("replay");
  const replayOut = document.getElementById("replay-result");
  replay.addEventListener("click", async function () {
    replay.disabled = true;
    show(replayOut, "replaying…", null);
    try {
      const res = await call("POST", "/replay", { mode: document.getElementById("replay-mode").value });
      const d = res.data;
      if (res.status >= 400) { show(replayOut, "replay refused: " + d.detail, "bad"); return; }
      let text = "Verdict: " + d.verdict + " (" + d.mode + ", " + d.tokens_compared + " tokens and " +
        d.checkpoints_compared + " checkpoints compared)";
      if (d.divergence_text) text += "\n" + d.divergence_text;
      (d.notes || []).forEach(function (n) { text += "\nnote: " + n; });
      show(replayOut, text, d.verdict === "identical" ? "ok" : "bad");
    } catch (e) { show(replayOut, "replay failed: " + e, "bad"); }
    finally { replay.disabled = false; }
  });

  const out = document.getElementById("approval-result");
  function answer(approved) {
    return async function () {
      const buttons = document.querySelectorAll("#approval button");
      buttons.forEach(function (b) { b.disabled = true; });
      show(out, approved ? "approving…" : "rejecting…", null);
      let done = false;
      try {
        const reply = document.getElementById("reply");
        const edited = reply && reply.value !== reply.defaultValue ? reply.value : null;
        const res = await call("POST", "/resume", { approved: approved, reply: edited });
        const d = res.data;
        if (res.status >= 400 || !d.ok) { show(out, "Not " + (approved ? "approved" : "rejected") + ": " + d.detail, "bad"); return; }
        done = true;
        show(out, (approved ? "Approved" : "Rejected") + ". Outcome: " + (d.outcome || "done") +
          (d.run_id ? " (run " + d.run_id + ")" : ""), "ok");
        if (d.run_url) {
          const a = document.createElement("a");
          a.href = d.run_url; a.textContent = " Open the resumed run"; a.id = "resumed-run";
          out.appendChild(a);
        }
      } catch (e) { show(out, "failed: " + e, "bad"); }
      finally { if (!done) buttons.forEach(function (b) { b.disabled = false; }); }
    };
  }
  const approve = document.getElementById("approve");
  if (approve) {
    approve.addEventListener("click", answer(true));
    document.getElementById("reject").addEventListener("click", answer(false));
  }
})();
