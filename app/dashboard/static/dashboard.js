// The llmq dashboard's one script, no dependencies: it refreshes the live parts of a page from
// their fragment routes, and runs the playground against the API (POST /v1/requests, its SSE
// events, cancel). Every call it makes carries the session's CSRF token.
(function () {
  "use strict";

  function csrfToken() {
    return document.querySelector('meta[name="csrf-token"]').content;
  }

  // An element with data-refresh="URL" is replaced by what URL renders, every data-every ms, for
  // as long as what it shows says data-live="true" (a batch still running, the fleet).
  function keepFresh(container) {
    const every = Number(container.dataset.every || 3000);
    async function tick() {
      if (!container.querySelector('[data-live="true"]')) return;
      try {
        const response = await fetch(container.dataset.refresh, {headers: {Accept: "text/html"}});
        if (response.redirected && new URL(response.url).pathname.endsWith("/login")) {
          window.location.href = response.url;  // the session ended (its key was revoked)
          return;
        }
        if (response.ok) container.innerHTML = await response.text();
      } catch (err) {
        // The server is away for a moment: the next tick asks again.
      }
      window.setTimeout(tick, document.hidden ? 5 * every : every);
    }
    window.setTimeout(tick, every);
  }

  function playground(form) {
    const output = document.getElementById("output");
    const status = document.getElementById("playground-status");
    const problem = document.getElementById("playground-error");
    const generate = document.getElementById("generate");
    const cancel = document.getElementById("cancel");
    let source = null;
    let requestId = null;
    let finishReason = null;

    function say(text) { status.textContent = text; }
    function fail(message) { problem.textContent = message; problem.hidden = false; }
    function end(text) {
      if (source) source.close();
      source = null;
      cancel.disabled = true;
      generate.disabled = false;
      say(text);
    }
    async function post(url, body) {
      const response = await fetch(url, {
        method: "POST", headers: {"Content-Type": "application/json", "X-CSRFToken": csrfToken()},
        body: JSON.stringify(body || {}),
      });
      const answer = await response.json().catch(() => ({}));
      if (!response.ok) throw new Error(answer.error ? answer.error.message : response.status + " " + response.statusText);
      return answer;
    }

    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      if (source) source.close();
      output.textContent = "";
      problem.hidden = true;
      finishReason = null;
      const body = {model: form.dataset.model, prompt: form.elements.prompt.value,
                    max_tokens: Number(form.elements.max_tokens.value),
                    temperature: Number(form.elements.temperature.value), top_p: Number(form.elements.top_p.value)};
      if (form.elements.seed.value !== "") body.seed = Number(form.elements.seed.value);
      if (form.elements.ignore_eos.checked) body.ignore_eos = true;
      generate.disabled = true;
      let created;
      try {
        created = await post(form.dataset.submit, body);
      } catch (err) {
        fail(err.message);
        end("not started");
        return;
      }
      requestId = created.id;
      cancel.disabled = false;
      say("queued as " + requestId);
      // cancel_on_disconnect: leaving the page stops the request and frees its place on the GPU.
      source = new EventSource("/v1/requests/" + requestId + "/events?cancel_on_disconnect=true");
      source.addEventListener("delta", (message) => {
        const delta = JSON.parse(message.data);
        if (delta.index !== 0) return;
        output.append(delta.text);
        if (delta.finish_reason) finishReason = delta.finish_reason;
        say("streaming " + requestId);
      });
      source.addEventListener("done", (message) => {
        const usage = JSON.parse(message.data).usage;
        const how = finishReason === "abort" ? "cancelled" : "finished (" + finishReason + ")";
        end(how + ": " + usage.completion_tokens + " tokens, " + usage.prompt_tokens + " prompt tokens");
      });
      source.addEventListener("error", (message) => {
        if (message.data) {  // the request's own error event
          const error = JSON.parse(message.data).error;
          if (error.code === "cancelled") { end("cancelled"); return; }
          fail(error.message);
          end("failed");
        } else if (source && source.readyState === EventSource.CLOSED) {
          end("the stream closed");
        }  // else the browser reconnects and resumes from the last event (Last-Event-ID)
      });
    });

    cancel.addEventListener("click", async () => {
      if (!requestId) return;
      cancel.disabled = true;
      say("cancelling " + requestId);
      try {
        await post("/v1/requests/" + requestId + "/cancel");
      } catch (err) {
        fail(err.message);
      }
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll("[data-refresh]").forEach(keepFresh);
    const form = document.getElementById("playground");
    if (form) playground(form);
  });
})();
