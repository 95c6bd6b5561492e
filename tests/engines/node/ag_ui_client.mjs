// A support turn through `durcap serve`'s AG-UI endpoint with @ag-ui/client's HttpAgent (what an AG-UI front end
// runs), then the approval through the /v1 API. Usage: node ag_ui_client.mjs BASE_URL TOKEN AGENT THREAD PROMPT
// Prints one JSON line per AG-UI event type seen, then `RESULT {...}`.
import { HttpAgent } from '@ag-ui/client';

const [base, token, agentName, threadId, prompt] = process.argv.slice(2);
const headers = { Authorization: `Bearer ${token}` };
const agent = new HttpAgent({ url: `${base}/v1/agents/${agentName}/ag-ui`, headers, threadId });
agent.addMessage({ id: `user-${Date.now()}`, role: 'user', content: prompt });

const types = [];
let run = null;
let interrupts = [];
let text = '';
await agent.runAgent({}, {
  onEvent({ event }) {
    types.push(event.type);
    if (event.type === 'CUSTOM' && event.name === 'durcap.run') run = event.value;
    if (event.type === 'TEXT_MESSAGE_CONTENT') text += event.delta;
    if (event.type === 'RUN_FINISHED' && event.outcome && event.outcome.type === 'interrupt') interrupts = event.outcome.interrupts;
  },
});
const decided = [];
for (const interrupt of interrupts) {
  const pending = await (await fetch(`${base}${run.approvals_url}`, { headers })).json();
  const call = pending.pending.find((c) => c.call_id === interrupt.toolCallId);
  const response = await fetch(`${base}/v1/runs/${run.run_id}/approvals/${call.call_id}`, {
    method: 'POST', headers: { ...headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ decision: 'approve', fingerprint: call.fingerprint }),
  });
  decided.push({ call_id: call.call_id, tool: call.tool_name, status: response.status });
}
console.log('RESULT ' + JSON.stringify({ run, types, interrupts, decided, text, messages: agent.messages.length }));
