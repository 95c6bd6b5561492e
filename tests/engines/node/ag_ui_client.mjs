// A support turn through `durcap serve`'s AG-UI endpoint with @ag-ui/client's HttpAgent (what an AG-UI front end
// runs), then the approval: through the /v1 API (MODE `api`), or as AG-UI resumes an interrupt (MODE `native`: a
// second run with `resume` entries, whose stream carries the rest of the run). Usage: node ag_ui_client.mjs BASE_URL
// TOKEN AGENT THREAD PROMPT [MODE]. Prints `RESULT {...}`.
import { HttpAgent } from '@ag-ui/client';

const [base, token, agentName, threadId, prompt, mode = 'api'] = process.argv.slice(2);
const headers = { Authorization: `Bearer ${token}` };
const agent = new HttpAgent({ url: `${base}/v1/agents/${agentName}/ag-ui`, headers, threadId });
agent.addMessage({ id: `user-${Date.now()}`, role: 'user', content: prompt });

const types = [];
let run = null;
let interrupts = [];
let text = '';
const subscriber = {
  onEvent({ event }) {
    types.push(event.type);
    if (event.type === 'CUSTOM' && event.name === 'durcap.run') run = event.value;
    if (event.type === 'TEXT_MESSAGE_CONTENT') text += event.delta;
    if (event.type === 'RUN_FINISHED' && event.outcome && event.outcome.type === 'interrupt') interrupts = event.outcome.interrupts;
  },
};
await agent.runAgent({}, subscriber);
const decided = [];
if (mode === 'native') {
  const asked = interrupts;
  interrupts = [];
  types.push('--native-approval--');
  await agent.runAgent({ resume: asked.map((i) => ({ interruptId: i.id, status: 'resolved', payload: { approved: true } })) },
    subscriber);
  for (const i of asked) decided.push({ call_id: i.toolCallId, tool: 'revoke_sessions', status: 200 });
  interrupts = asked;
}
for (const interrupt of mode === 'native' ? [] : interrupts) {
  const pending = await (await fetch(`${base}${run.approvals_url}`, { headers })).json();
  const call = pending.pending.find((c) => c.call_id === interrupt.toolCallId);
  const response = await fetch(`${base}/v1/runs/${run.run_id}/approvals/${call.call_id}`, {
    method: 'POST', headers: { ...headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ decision: 'approve', fingerprint: call.fingerprint }),
  });
  decided.push({ call_id: call.call_id, tool: call.tool_name, status: response.status });
}
console.log('RESULT ' + JSON.stringify({ run, types, interrupts, decided, text, messages: agent.messages.length }));
