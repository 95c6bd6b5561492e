// A support turn through `durcap serve`'s Vercel AI endpoint with the ai SDK's DefaultChatTransport (what useChat
// sends and reads), then the approval: through the /v1 API (MODE `api`), or as useChat sends it after
// addToolApprovalResponse (MODE `native`: the assistant message's tool part `approval-responded`, sent back on the
// same endpoint, whose stream then carries the rest of the run). Usage: node vercel_ai_client.mjs BASE_URL TOKEN
// AGENT CHAT_ID PROMPT [MODE]. Prints `RESULT {...}`: chunk types, the run, the approval requests, the decisions.
import { DefaultChatTransport, readUIMessageStream } from 'ai';

const [base, token, agentName, chatId, prompt, mode = 'api'] = process.argv.slice(2);
const headers = { Authorization: `Bearer ${token}` };
const transport = new DefaultChatTransport({ api: `${base}/v1/agents/${agentName}/vercel-ai`, headers });
const messages = [{ id: `user-${Date.now()}`, role: 'user', parts: [{ type: 'text', text: prompt }] }];
const types = [];
let run = null;
const approvals = [];

async function send(sent, message) {
  const stream = await transport.sendMessages({
    chatId, messages: sent, trigger: 'submit-message', messageId: undefined, abortSignal: undefined,
  });
  const [chunks, forMessage] = stream.tee();
  let last = null;
  // Like useChat, a stream answering an approval continues the assistant message it was sent with.
  const reading = (async () => { for await (const m of readUIMessageStream({ stream: forMessage, message })) last = m; })();
  for await (const chunk of chunks) {
    types.push(chunk.type);
    if (chunk.type === 'data-durcap-run') run = chunk.data;
    if (chunk.type === 'tool-approval-request') approvals.push(chunk);
    if (chunk.type === 'error') throw new Error(chunk.errorText);
  }
  await reading;
  return last;
}

let last = await send(messages);
const decided = [];
if (mode === 'native') {
  // What useChat's addToolApprovalResponse does to the assistant message before it sends the chat again.
  const assistant = structuredClone(last);
  for (const part of assistant.parts) {
    if (part.state === 'approval-requested') {
      part.state = 'approval-responded';
      part.approval = { ...part.approval, approved: true };
      decided.push({ call_id: part.toolCallId, tool: part.type.replace(/^tool-/, ''), status: 200 });
    }
  }
  types.push('--native-approval--');
  last = await send([...messages, assistant], structuredClone(assistant));
}
for (const request of mode === 'native' ? [] : approvals) {
  const pending = await (await fetch(`${base}${run.approvals_url}`, { headers })).json();
  const call = pending.pending.find((c) => c.call_id === request.toolCallId);
  const response = await fetch(`${base}/v1/runs/${run.run_id}/approvals/${call.call_id}`, {
    method: 'POST', headers: { ...headers, 'Content-Type': 'application/json' },
    body: JSON.stringify({ decision: 'approve', fingerprint: call.fingerprint }),
  });
  decided.push({ call_id: call.call_id, tool: call.tool_name, status: response.status });
}
const parts = last ? last.parts.map((p) => p.type) : [];
const text = last ? last.parts.filter((p) => p.type === 'text').map((p) => p.text).join('') : '';
console.log('RESULT ' + JSON.stringify({ run, types, approvals, decided, parts, text }));
