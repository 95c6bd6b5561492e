// A support turn through `durcap serve`'s Vercel AI endpoint with the ai SDK's DefaultChatTransport (what useChat
// sends and reads), then the approval through the /v1 API. Usage: node vercel_ai_client.mjs BASE_URL TOKEN AGENT
// CHAT_ID PROMPT. Prints `RESULT {...}`: the chunk types read, the run, the approval requests and the decisions.
import { DefaultChatTransport, readUIMessageStream } from 'ai';

const [base, token, agentName, chatId, prompt] = process.argv.slice(2);
const headers = { Authorization: `Bearer ${token}` };
const transport = new DefaultChatTransport({ api: `${base}/v1/agents/${agentName}/vercel-ai`, headers });
const messages = [{ id: `user-${Date.now()}`, role: 'user', parts: [{ type: 'text', text: prompt }] }];
const stream = await transport.sendMessages({
  chatId, messages, trigger: 'submit-message', messageId: undefined, abortSignal: undefined,
});
const types = [];
let run = null;
const approvals = [];
const [chunks, forMessage] = stream.tee();
let last = null;
const reading = (async () => { for await (const message of readUIMessageStream({ stream: forMessage })) last = message; })();
for await (const chunk of chunks) {
  types.push(chunk.type);
  if (chunk.type === 'data-durcap-run') run = chunk.data;
  if (chunk.type === 'tool-approval-request') approvals.push(chunk);
  if (chunk.type === 'error') throw new Error(chunk.errorText);
}
await reading;
const decided = [];
for (const request of approvals) {
  const pending = await (await fetch(`${base}${run.approvals_url}`, { headers })).json();
  const call = pending.pending.find((c) => c.call_id === request.toolCallId);
  const response = await fetch(`${base}/v1/runs/${run.run_id}/approvals/${call.call_id}`, {
    method: 'POST', headers: { ...headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ decision: 'approve', fingerprint: call.fingerprint }),
  });
  decided.push({ call_id: call.call_id, tool: call.tool_name, status: response.status });
}
const parts = last ? last.parts.map((p) => p.type) : [];
console.log('RESULT ' + JSON.stringify({ run, types, approvals, decided, parts }));
