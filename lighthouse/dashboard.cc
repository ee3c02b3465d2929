#include "lighthouse/dashboard.h"

namespace lk::lighthouse {

std::string_view DashboardHtml() {
  static constexpr std::string_view kHtml = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Lightkeeper</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
 header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:20px;align-items:baseline}
 header h1{font-size:18px;margin:0} #meta{opacity:.75}
 main{padding:16px 20px} .job{background:#fff;border:1px solid #dde1e7;border-radius:6px;margin-bottom:16px;padding:12px 16px}
 .job h2{font-size:16px;margin:0 0 6px} .kv{display:flex;gap:24px;flex-wrap:wrap;margin-bottom:8px}
 .kv b{font-variant-numeric:tabular-nums} table{border-collapse:collapse;width:100%}
 th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eef0f3;font-variant-numeric:tabular-nums}
 th{font-weight:600;color:#5a6270} .member{color:#0a7a3b;font-weight:600} .joining,.waiting{color:#a26b00}
 .left,.evicted{color:#b3261e} .draining{color:#6b4fbb} .bad{color:#b3261e;font-weight:600}
 #err{color:#b3261e} .decision{color:#5a6270;font-size:12px}
</style></head><body>
<header><h1>Lightkeeper</h1><span id="meta">connecting…</span><span id="err"></span></header>
<main id="jobs"></main>
<script>
"use strict";
const token = (location.hash.match(/token=([^&]+)/) || [])[1];
function esc(s){return String(s).replace(/[&<>"']/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;","'":"&#39;"}[c]));}
function render(st){
  document.getElementById("meta").textContent =
    `${(st.jobs||[]).length} job(s) · up ${Math.round(st.uptime_s||0)} s · ${new Date().toLocaleTimeString()}`;
  const html = (st.jobs||[]).map(j => {
    const rows = (j.groups||[]).map(g => `<tr>
      <td>${esc(g.group_id)}</td><td class="${esc(g.state)}">${esc(g.state)}</td>
      <td>${g.step}</td><td>${g.nodes}</td><td>${(g.heartbeat_age_ms/1000).toFixed(1)} s</td>
      <td>${esc(g.phase||"")}</td><td>${g.diverged?'<span class="bad">diverged</span>':''}</td>
      <td>${g.tokens_step?`${esc(String(g.tokens))} @${g.tokens_step} (${((g.share||0)*100).toFixed(1)}%)`:""}</td>
      <td>${esc(g.incarnation)}</td><td class="decision">${esc(g.reason||"")}</td></tr>`).join("");
    const members = (j.members||[]).map((m,i)=>`${i}:${esc(m.group_id)}`).join(" ");
    return `<section class="job"><h2>${esc(j.job)}</h2><div class="kv">
      <span>quorum_id <b>${j.quorum_id}</b></span><span>committed step <b>${j.committed_step}</b></span>
      <span>members <b>${(j.members||[]).length}</b> (${members})</span>
      <span>quorum changes <b>${j.quorum_changes}</b></span>
      <span>checkpoints <b>${(j.checkpoints||[]).length}</b></span></div>
      <div class="decision">${esc(j.last_decision||"")}</div>
      <table><thead><tr><th>group</th><th>state</th><th>step</th><th>nodes</th><th>heartbeat</th>
      <th>phase</th><th></th><th>tokens @step (share)</th><th>incarnation</th><th>reason</th></tr></thead><tbody>${rows}</tbody></table></section>`;
  }).join("");
  document.getElementById("jobs").innerHTML = html || "<p>No jobs yet.</p>";
}
async function poll(){
  try {
    const r = await fetch("/status", {headers: token ? {Authorization: "Bearer " + token} : {}});
    if (!r.ok) throw new Error(`/status answered ${r.status}`);
    render(await r.json());
    document.getElementById("err").textContent = "";
  } catch (e) { document.getElementById("err").textContent = String(e.message || e); }
  setTimeout(poll, 1000);
}
poll();
</script></body></html>
)HTML";
  return kHtml;
}

}  // namespace lk::lighthouse
