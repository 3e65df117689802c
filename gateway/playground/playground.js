// sluicegate's playground: chat with a model through the gateway, stream the answer, stop it,
// and follow the same run again when the network drops. Plain JS, no build step.
//
// The API key stays in this tab's sessionStorage. A run starts with a streamed POST (fetch, so
// it can send the key); if that stream breaks before `[DONE]`, the page follows the run again
// with an EventSource on the run's URL and its follow token (`x-follow-token`), from the last
// event id it has, so no text is lost or repeated; the EventSource itself resumes any later
// drop with Last-Event-ID, and sluicegate's 204 at the run's end stops it.
"use strict";

const KEY_STORE = "sluicegate.apiKey";
const $ = (id) => document.getElementById(id);
const conversation = []; // the messages sent with each question
let run = null; // the run being answered

function authHeaders() {
  return { Authorization: `Bearer ${$("api-key").value.trim()}` };
}

function show(id, text) {
  $(id).textContent = text;
}

function addMessage(role, text) {
  const node = document.createElement("div");
  node.className = `message ${role}`;
  node.textContent = text;
  $("transcript").appendChild(node);
  return node;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return body.error ? `${resp.status}: ${body.error.message}` : `HTTP ${resp.status}`;
  } catch {
    return `HTTP ${resp.status}`;
  }
}

async function loadModels() {
  const select = $("model");
  select.replaceChildren();
  if (!$("api-key").value.trim()) {
    show("notice", "Enter an API key to list the models.");
    return;
  }
  const resp = await fetch("/v1/models", { headers: authHeaders() });
  if (!resp.ok) {
    show("notice", `Models: ${await errorText(resp)}`);
    return;
  }
  for (const model of (await resp.json()).data) {
    select.appendChild(new Option(model.id, model.id));
  }
  show("notice", "");
}

// One event of the run's stream, from the POST or from a resume: its id and its data.
function onEvent(id, data) {
  if (data === "[DONE]") {
    run.done = true;
    return;
  }
  if (id) run.lastId = Number(id);
  const body = JSON.parse(data);
  if (body.error) {
    run.error = body.error;
    addMessage("error", `${body.error.code}: ${body.error.message}`);
    return;
  }
  if (!run.id) {
    run.id = body.id;
    show("run-id", run.id);
  }
  for (const choice of body.choices) {
    const piece = choice.delta && choice.delta.content;
    if (piece) {
      if (run.ttft === null) {
        run.ttft = performance.now() - run.started;
        show("ttft", `${Math.round(run.ttft)} ms`);
      }
      run.text += piece;
      run.node.textContent = run.text;
    }
  }
  if (body.usage) {
    const u = body.usage;
    show("usage", `${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`);
  }
}

// Server-sent events from a fetch body: `id:`/`data:` lines, a blank line ends an event; an
// event cut off by a dropped connection is never dispatched.
async function readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let id = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, "");
      buffer = buffer.slice(end + 1);
      if (line === "") {
        if (data.length) onEvent(id, data.join("\n"));
        id = "";
        data = [];
      } else if (line.startsWith("id:")) {
        id = line.slice(3).trim();
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      } // comments (`: ping`) and `retry:` need nothing here
    }
  }
}

// Follow the run again from the last event we have, with its follow token in the URL.
function resume() {
  return new Promise((resolve) => {
    const params = new URLSearchParams({ stream: "true", token: run.token });
    params.set("starting_after", String(run.lastId));
    const source = new EventSource(`/v1/chat/completions/${run.id}?${params}`);
    run.source = source;
    const opened = () => {
      run.resumes += 1;
      show("resumes", String(run.resumes));
      show("run-status", "streaming (resumed)");
    };
    source.addEventListener("open", opened);
    source.addEventListener("message", (event) => {
      onEvent(event.lastEventId, event.data);
      if (run.done) {
        source.close();
        resolve();
      }
    });
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) resolve(); // the 204, or refused
      else show("run-status", "reconnecting…");
    });
  });
}

async function finish() {
  $("stop").disabled = true;
  $("send").disabled = false;
  if (!run.id) return;
  const resp = await fetch(
    `/v1/chat/completions/${run.id}?token=${encodeURIComponent(run.token)}`,
  );
  const status = resp.ok ? (await resp.json()).status : await errorText(resp);
  show("run-status", status);
  if (status === "completed") {
    conversation.push({ role: "assistant", content: run.text });
  }
}

function temperatureOf(value) {
  // the field as typed; blank or not a number: the API's own default (1)
  const t = parseFloat(value);
  return Number.isFinite(t) ? t : 1;
}

async function ask(question) {
  conversation.push({ role: "user", content: question });
  addMessage("user", question);
  run = {
    id: null, token: null, lastId: 0, text: "", done: false, error: null, ttft: null,
    resumes: 0, started: performance.now(), node: addMessage("assistant", ""), source: null,
  };
  ["run-id", "ttft", "usage"].forEach((id) => show(id, "–"));
  show("resumes", "0");
  show("run-status", "starting");
  $("send").disabled = true;
  const resp = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { ...authHeaders(), "Content-Type": "application/json" },
    body: JSON.stringify({
      model: $("model").value,
      messages: conversation,
      max_tokens: Number($("max-tokens").value) || 256,
      temperature: temperatureOf($("temperature").value),
      stream: true,
      stream_options: { include_usage: true },
    }),
  }).catch((err) => ({ ok: false, status: 0, json: async () => ({ error: { message: String(err) } }) }));
  if (!resp.ok) {
    conversation.pop();
    addMessage("error", await errorText(resp));
    show("run-status", "refused");
    $("send").disabled = false;
    return;
  }
  run.token = resp.headers.get("x-follow-token");
  $("stop").disabled = false;
  show("run-status", "streaming");
  try {
    await readEvents(resp.body);
  } catch {
    // the connection dropped: the run goes on on the server, and is followed again below
  }
  if (!run.done && run.id) {
    show("run-status", "connection lost, resuming…");
    await resume();
  } else if (!run.done) {
    show("run-status", "connection lost before the run's first event");
  }
  await finish();
}

async function stop() {
  if (!run || !run.id) return;
  $("stop").disabled = true;
  const resp = await fetch(`/v1/chat/completions/${run.id}/cancel`, {
    method: "POST",
    headers: authHeaders(),
  });
  show("run-status", resp.ok ? (await resp.json()).status : await errorText(resp));
}

function start() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, key.value.trim());
    loadModels();
  });
  $("ask").addEventListener("submit", (event) => {
    event.preventDefault();
    const question = $("prompt").value.trim();
    if (!question || !$("model").value) return;
    $("prompt").value = "";
    ask(question);
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    conversation.length = 0;
    $("transcript").replaceChildren();
  });
  loadModels();
}

start();
