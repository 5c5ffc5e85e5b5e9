"""The `llmq` commands that call a running service over HTTP (stack/client.py), registered from
stack/cli.py: the batch commands (stack/batch_client_cli.py), and here `complete` and `requests tail`.

    llmq complete "Once upon a time" [--stream] [--max-tokens N --temperature T --top-p P --seed S --stop X
                                      --model M]
    llmq requests tail REQUEST_ID [--retries N]

`complete` prints the completion's text (choice 0) and a newline on stdout, its finish reason on
stderr; --stream prints the text as it is made. The model defaults to the one the service serves
(GET /v1/models). `requests tail` follows a request's events (GET /v1/requests/{id}/events), printing
choice 0's text as it comes, and when the connection drops it reconnects with Last-Event-ID, backing
off between attempts (at most --retries in a row without an event): nothing is printed twice, nothing
is lost. It ends with the request: exit 0 once done, 1 on an error event (cancelled, failed).

Every client command takes --url, --api-key and --json (stack/client_commands.py, which also lists
the exit codes); stack/client_config.py says where the URL and key come from when not given.
"""
from __future__ import annotations

import json
import time

from stack.batch_client_cli import add_batch_client_commands
from stack.client_commands import (
    NOT_COMPLETED,
    OK,
    client_command,
    connect,
    connection_options,
    note,
    print_json,
    write_out,
)

TAIL_RETRIES = 10
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 8.0
TERMINAL_REQUEST_STATES = ("completed", "failed", "cancelled")


def add_client_commands(commands, batch) -> None:
    """Add the service's commands to the `llmq` parser: `complete` and `requests` to its commands,
    submit / list / status / results / cancel to its `batch` subcommands."""
    connection = connection_options()
    add_batch_client_commands(batch, connection)

    complete = commands.add_parser("complete", parents=[connection], help="one completion from the service "
                                                                          "(POST /v1/completions)")
    complete.add_argument("prompt")
    complete.add_argument("--stream", action="store_true", help="print the text as it is made")
    complete.add_argument("--model", help="default: the model the service serves")
    complete.add_argument("--max-tokens", type=int, help="default: the service's")
    complete.add_argument("--temperature", type=float)
    complete.add_argument("--top-p", type=float)
    complete.add_argument("--seed", type=int)
    complete.add_argument("--stop", action="append", help="stop string (repeatable)")
    complete.set_defaults(func=cmd_complete)

    requests = commands.add_parser("requests", help="single requests on the service").add_subparsers(
        dest="requests_command", required=True)
    tail = requests.add_parser("tail", parents=[connection], help="follow a request's text as it is made, "
                                                                  "resuming after a dropped connection")
    tail.add_argument("request_id", help="cmpl-... (from POST /v1/requests or /v1/completions)")
    tail.add_argument("--retries", type=int, default=TAIL_RETRIES,
                      help=f"reconnections in a row without an event before giving up (default {TAIL_RETRIES})")
    tail.set_defaults(func=cmd_tail)


@client_command
def cmd_complete(args) -> int:
    with connect(args) as client:
        body = {"model": args.model or client.served_model(), "prompt": args.prompt}
        for name in ("max_tokens", "temperature", "top_p", "seed", "stop"):
            if getattr(args, name) is not None:
                body[name] = getattr(args, name)
        if not args.stream:
            completion = client.complete(body)
            if args.json:
                print_json(completion)
            else:
                choice = completion["choices"][0]
                write_out(choice["text"] + "\n")
                note(f"[finish_reason: {choice['finish_reason']}, {completion['usage']['completion_tokens']} tokens]")
            return OK
        finish_reason = None
        for chunk in client.stream_completion({**body, "stream_options": {"include_usage": True}}):
            if args.json:
                print_json(chunk)
            if "error" in chunk:
                _end_line(args)
                error = chunk["error"]
                note(f"llmq: error: the completion ended with {error.get('code')}: {error.get('message')}")
                return NOT_COMPLETED
            for choice in chunk.get("choices") or ():
                if choice["index"] == 0:
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if not args.json:
                        write_out(choice["text"])
        _end_line(args)
        note(f"[finish_reason: {finish_reason}]")
        return OK


@client_command
def cmd_tail(args) -> int:
    from stack.client import ServiceError, ServiceUnreachable

    printed, last_id, failures = "", None, 0
    with connect(args) as client:
        while True:
            try:
                for event in client.request_events(args.request_id, last_id):
                    failures, last_id = 0, event.id or last_id
                    payload = json.loads(event.data)
                    if args.json:
                        print_json({"id": event.id, **payload})
                    if event.event == "delta" and payload["index"] == 0 and not args.json:
                        write_out(payload["text"])
                        printed += payload["text"]
                    if event.event == "done":
                        _end_line(args)
                        return OK
                    if event.event == "error":
                        _end_line(args)
                        error = payload["error"]
                        note(f"llmq: request {args.request_id} ended with {error['code']}: {error['message']}")
                        return NOT_COMPLETED
                # The stream ended without its last event: the service is going away, or it answered
                # 204 because we had it all; the request itself says which.
                final = client.request(args.request_id)
                if final["status"] in TERMINAL_REQUEST_STATES:
                    return _finish_from_request(final, printed, args)
                lost = "the stream ended before the request did"
            except ServiceError as err:
                if err.status == 410:  # the stream expired: the stored result is what is left
                    return _finish_from_request(client.request(args.request_id), printed, args)
                if err.status < 500:
                    raise
                lost = str(err)
            except ServiceUnreachable as err:
                lost = str(err)
            failures += 1
            if failures > args.retries:
                raise ServiceUnreachable(f"gave up on request {args.request_id} after {args.retries} reconnections "
                                         f"without an event: {lost}")
            delay = min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S)
            note(f"\nllmq: {lost}; resuming after event {last_id or '(none)'} in {delay:g} s "
                 f"({failures}/{args.retries})")
            time.sleep(delay)


def _finish_from_request(request: dict, printed: str, args) -> int:
    """End a tail from the request object: the text not printed yet, and the exit code by its status."""
    if args.json:
        print_json(request)
    else:
        text = request.get("text") or ""
        if text.startswith(printed):
            write_out(text[len(printed):])
        _end_line(args)
    if request["status"] == "completed":
        return OK
    error = request.get("error") or {}
    note(f"llmq: request {request['id']} is {request['status']}: {error.get('message', 'no error given')}")
    return NOT_COMPLETED


def _end_line(args) -> None:
    if not args.json:
        write_out("\n")
