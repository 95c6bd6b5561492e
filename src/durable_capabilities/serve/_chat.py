"""`durcap serve --chat`: one small page at `/chat` that uses the `/v1` API from the browser (no build step, no
third-party script): a turn's answer as it streams (SSE read with `fetch`, so the bearer token goes in a header),
approve / deny buttons for calls waiting for a person, and reconnection (`Last-Event-ID`) after a dropped connection
or a page reload (the run and what was shown are kept in `sessionStorage`).

Safety: everything from the model or the run (the answer, a tool's arguments) is put on the page with
`textContent`, never as HTML; the agent names are passed as JSON in a `<script type="application/json">` element
with `<`, `>` and `&` escaped. The page sends the token only to its own origin.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>durcap chat</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
label { display: inline-block; margin: .2rem .8rem .2rem 0; }
input[type=text], input[type=password], select { padding: .3rem; }
#prompt { width: 70%; }
#answer { white-space: pre-wrap; border: 1px solid #ccc; padding: .8rem; min-height: 3rem; margin: 1rem 0; }
.call { border: 1px solid #d90; background: #fff8e8; padding: .6rem; margin: .5rem 0; }
.call pre { white-space: pre-wrap; margin: .3rem 0; }
#status { color: #555; }
</style></head>
<body>
<h1>durcap chat</h1>
<script type="application/json" id="agents">__AGENTS__</script>
<div>
  <label>Token <input type="password" id="token" autocomplete="off"></label>
  <label>Agent <select id="agent"></select></label>
  <label>Conversation <input type="text" id="conversation"></label>
</div>
<div><input type="text" id="prompt" placeholder="Your message"> <button id="send">Send</button></div>
<p>Run: <code id="run"></code> <span id="status"></span></p>
<div id="answer"></div>
<div id="approvals"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const agents = JSON.parse($('agents').textContent);
for (const name of agents) { const o = document.createElement('option'); o.value = name; o.textContent = name; $('agent').appendChild(o); }
const saved = JSON.parse(sessionStorage.getItem('durcap-chat') || '{}');
$('token').value = sessionStorage.getItem('durcap-token') || '';
$('conversation').value = saved.conversation || ('chat-' + Math.random().toString(36).slice(2, 10));
if (saved.agent) $('agent').value = saved.agent;
let state = saved.run ? saved : null;

function save() { sessionStorage.setItem('durcap-chat', JSON.stringify(state || {conversation: $('conversation').value})); }
function headers(extra) { return Object.assign({'Authorization': 'Bearer ' + $('token').value}, extra || {}); }
function setStatus(text) { $('status').textContent = text; }

// The answer: the text of the last model request that produced text, retried attempts dropped (streams.answer_text).
function render() {
  const dropped = new Set(state.discarded);
  let unit = null, text = '';
  for (const [u, attempt, chunk] of state.parts) {
    if (dropped.has(u + '#' + attempt)) continue;
    if (u !== unit) { unit = u; text = ''; }
    text += chunk;
  }
  $('answer').textContent = text;
  $('run').textContent = state.run;
}
function textOf(ev) {
  const e = ev.event || {};
  if (e.event_kind === 'part_delta' && e.delta && e.delta.part_delta_kind === 'text') return e.delta.content_delta;
  if (e.event_kind === 'part_start' && e.part && e.part.part_kind === 'text') return e.part.content;
  return '';
}
function showCalls(calls) {
  const box = $('approvals');
  box.replaceChildren();
  for (const call of calls) {
    const div = document.createElement('div'); div.className = 'call'; div.dataset.callId = call.call_id;
    const title = document.createElement('div'); title.textContent = 'Approve ' + call.tool_name + '?';
    const args = document.createElement('pre'); args.className = 'args'; args.textContent = JSON.stringify(call.args, null, 2);
    div.append(title, args);
    for (const [label, decision] of [['Approve', 'approve'], ['Deny', 'deny']]) {
      const b = document.createElement('button'); b.textContent = label; b.className = decision;
      b.onclick = () => decide(call, decision, div); div.appendChild(b);
    }
    box.appendChild(div);
  }
}
async function decide(call, decision, div) {
  const r = await fetch('v1/runs/' + encodeURIComponent(state.run) + '/approvals/' + encodeURIComponent(call.call_id), {
    method: 'POST', headers: headers({'Content-Type': 'application/json'}),
    body: JSON.stringify({decision: decision, fingerprint: call.fingerprint})});
  const body = await r.json();
  const note = document.createElement('div');
  note.textContent = r.ok ? (decision + 'd') : ('refused: ' + body.error.message);
  div.replaceChildren(note);
}
function handle(kind, ev) {
  if (kind === 'text_delta') { state.parts.push([ev.unit, ev.attempt, textOf(ev)]); render(); }
  else if (kind === 'retry') { for (const a of ev.data.discard_attempts || []) state.discarded.push(ev.unit + '#' + a); render(); }
  else if (kind === 'approval_waiting') { state.calls = ev.data.calls; showCalls(state.calls); setStatus('waiting for approval'); }
  else if (kind === 'approval_decided') { state.calls = []; $('approvals').replaceChildren(); setStatus('running'); }
  else if (kind === 'run_completed') { state.done = 'completed'; setStatus('completed'); }
  else if (kind === 'run_waiting') { setStatus('waiting: ' + (ev.data.notice || 'for a worker')); }
  else if (kind === 'run_failed') { state.done = 'failed'; setStatus('failed: ' + (ev.data.error || '')); }
}
async function follow() {
  while (state && !state.done) {
    try {
      const r = await fetch('v1/runs/' + encodeURIComponent(state.run) + '/events', {
        headers: headers(state.last ? {'Last-Event-ID': String(state.last)} : {})});
      if (!r.ok) { const b = await r.json(); setStatus('error: ' + b.error.message); return; }
      setStatus(state.calls && state.calls.length ? 'waiting for approval' : 'running');
      const reader = r.body.getReader(); const decoder = new TextDecoder(); let buffer = '';
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, {stream: true});
        let cut;
        while ((cut = buffer.indexOf('\n\n')) >= 0) {
          const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
          const f = {};
          for (const line of block.split('\n')) { const i = line.indexOf(': '); if (i > 0) f[line.slice(0, i)] = line.slice(i + 2); }
          if (!f.id) continue;
          handle(f.event, JSON.parse(f.data));
          state.last = Number(f.id); save();
        }
      }
    } catch (err) { setStatus('reconnecting: ' + err); }
    if (state && !state.done) await new Promise((ok) => setTimeout(ok, 1000));
  }
}
$('send').onclick = async () => {
  sessionStorage.setItem('durcap-token', $('token').value);
  const conversation = $('conversation').value;
  const r = await fetch('v1/conversations/' + encodeURIComponent(conversation) + '/turns', {
    method: 'POST', headers: headers({'Content-Type': 'application/json', 'Idempotency-Key': 'chat-' + crypto.randomUUID()}),
    body: JSON.stringify({agent: $('agent').value, prompt: $('prompt').value})});
  const body = await r.json();
  if (!r.ok) { setStatus('refused: ' + body.error.message); return; }
  state = {run: body.run_id, conversation: conversation, agent: $('agent').value, last: 0, parts: [], discarded: [],
           calls: [], done: null};
  save(); render(); $('approvals').replaceChildren(); follow();
};
if (state) { render(); if (state.calls && state.calls.length) showCalls(state.calls); setStatus(state.done || 'reconnecting'); follow(); }
</script>
</body></html>
"""


def chat_page(request: Request) -> Response:
    """The chat page (`GET /chat`): static but for the served agents' names (JSON, HTML-escaped)."""
    names = sorted(request.app.state.serve.agents)
    data = json.dumps(names).replace('<', '\\u003c').replace('>', '\\u003e').replace('&', '\\u0026')
    return HTMLResponse(_PAGE.replace('__AGENTS__', data), headers={
        # frame-ancestors / X-Frame-Options: no other site frames the page's approval buttons (clickjacking)
        'Content-Security-Policy': "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                   "frame-ancestors 'none'",
        'X-Frame-Options': 'DENY', 'X-Content-Type-Options': 'nosniff', 'Cache-Control': 'no-store'})
