"""`llmq batch submit | list | status | results | cancel`: batch jobs on a running service, over its
OpenAI Batch API (the offline `llmq batch run` is in stack/cli.py).

    llmq batch submit IN.jsonl [--endpoint /v1/chat/completions] [--wait [-o OUT.jsonl [--errors E.jsonl]]]
    llmq batch list [--limit N] [--after BATCH_ID]
    llmq batch status BATCH_ID [--wait]
    llmq batch results BATCH_ID [-o OUT.jsonl [--errors E.jsonl]] [--wait]
    llmq batch cancel BATCH_ID

`submit` prints the batch id alone on stdout (B=$(llmq batch submit in.jsonl) works). Results go to
OUT and its errors file (default: OUT with .errors.jsonl, as `llmq batch run` names it), both written
even when empty, so a script finds them; without -o the output lines go to stdout and the error lines
to stderr. Exit codes: stack/client_commands.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from stack.client_commands import (
    LINES_FAILED,
    NOT_COMPLETED,
    OK,
    UsageError,
    client_command,
    connect,
    note,
    print_json,
    progress_bar,
)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
ENDED = ("completed", "failed", "cancelled", "expired")
POLL_SECONDS = 0.5
# While waiting, a web server that restarts or a network that blips costs a few polls, not the wait.
WAIT_RETRIES = 10


def add_batch_client_commands(batch, connection) -> None:
    """Add the service's batch commands to `llmq batch` (beside the offline `run`)."""
    submit = batch.add_parser("submit", parents=[connection], help="upload a batch input file (JSONL) to the "
                                                                   "service and create a batch from it")
    submit.add_argument("input", type=Path, help="OpenAI batch input lines: custom_id, method, url, body")
    submit.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0], help="what every line calls")
    submit.add_argument("--completion-window", default="24h", help="how long the batch may take (24h; llmq also "
                                                                   "takes e.g. 90s, 30m, 72h)")
    submit.add_argument("--wait", action="store_true", help="follow it to its end, then write its results")
    _add_result_options(submit)
    submit.set_defaults(func=cmd_submit)

    listing = batch.add_parser("list", parents=[connection], help="your batches, newest first")
    listing.add_argument("--limit", type=int, default=20, help="how many (1-100)")
    listing.add_argument("--after", help="the last batch id of the previous page")
    listing.set_defaults(func=cmd_list)

    status = batch.add_parser("status", parents=[connection], help="a batch's status and line counts")
    status.add_argument("batch_id")
    status.add_argument("--wait", action="store_true", help="follow it to its end (exit code by how it ended)")
    status.set_defaults(func=cmd_status)

    results = batch.add_parser("results", parents=[connection], help="a finished batch's output and error lines")
    results.add_argument("batch_id")
    results.add_argument("--wait", action="store_true", help="wait for the batch to end first")
    _add_result_options(results)
    results.set_defaults(func=cmd_results)

    cancel = batch.add_parser("cancel", parents=[connection], help="cancel a batch: lines not started never run, "
                                                                   "running lines stop")
    cancel.add_argument("batch_id")
    cancel.set_defaults(func=cmd_cancel)


def _add_result_options(parser) -> None:
    parser.add_argument("-o", "--output", type=Path, help="write the output lines here (default: stdout)")
    parser.add_argument("--errors", type=Path, help="write the error lines here (default: OUTPUT with "
                                                    ".errors.jsonl; without -o, stderr)")


@client_command
def cmd_submit(args) -> int:
    if (args.output or args.errors) and not args.wait:
        raise UsageError("-o/--errors write a batch's results, which come at its end: add --wait (or use "
                         "`llmq batch results BATCH_ID -o ...` later)")
    if not args.input.is_file():
        raise UsageError(f"cannot read the batch input file {str(args.input)!r}: "
                         f"{'it is a folder' if args.input.is_dir() else 'no such file'}")
    with connect(args) as client:
        uploaded = client.upload_batch_file(args.input)
        batch = client.create_batch(uploaded["id"], args.endpoint, args.completion_window)
        note(f"batch {batch['id']} created from {args.input} ({uploaded['bytes']} bytes, {uploaded['id']})"
             + ("" if args.wait else f"; follow it with `llmq batch status {batch['id']} --wait`"))
        if not args.wait:
            print_json(batch) if args.json else print(batch["id"])
            return OK
        batch = wait_for_end(client, batch)
        return _write_results(client, batch, args)


@client_command
def cmd_list(args) -> int:
    with connect(args) as client:
        page = client.list_batches(args.limit, args.after)
    if args.json:
        for batch in page["data"]:
            print_json(batch)
    else:
        columns = ("id", "status", "created", "completed", "failed", "total", "endpoint")
        rows = [[b["id"], b["status"], _time(b["created_at"]), *_counts(b), b["endpoint"]] for b in page["data"]]
        widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows)]
        for row in (columns, *rows):
            print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    if page["has_more"]:
        note(f"more: llmq batch list --after {page['last_id']}")
    return OK


def _batch(client, args) -> dict:
    """The batch as it is now, or with --wait as it ends (a progress bar meanwhile, on a terminal)."""
    batch = client.batch(args.batch_id)
    return wait_for_end(client, batch) if args.wait else batch


@client_command
def cmd_status(args) -> int:
    with connect(args) as client:
        batch = _batch(client, args)
    if args.json:
        print_json(batch)
    else:
        completed, failed, total = _counts(batch)
        print(f"{batch['id']}  {batch['status']}  {completed} completed, {failed} failed of {total}  "
              f"({batch['endpoint']}, created {_time(batch['created_at'])})")
        for name in ("input_file_id", "output_file_id", "error_file_id"):
            if batch.get(name):
                print(f"  {name}: {batch[name]}")
        _print_batch_errors(batch)
    return ended_code(batch) if args.wait else OK


@client_command
def cmd_results(args) -> int:
    with connect(args) as client:
        batch = _batch(client, args)
        if batch["status"] not in ENDED:
            note(f"llmq: error: batch {batch['id']} is {batch['status']}: its results come when it ends "
                 f"(add --wait, or see `llmq batch status {batch['id']}`)")
            return NOT_COMPLETED
        return _write_results(client, batch, args)


@client_command
def cmd_cancel(args) -> int:
    with connect(args) as client:
        batch = client.cancel_batch(args.batch_id)
    if args.json:
        print_json(batch)
    else:
        print(f"{batch['id']}  {batch['status']}")
    return OK


def wait_for_end(client, batch: dict) -> dict:
    """Poll the batch until it ends, with a progress bar of its lines (on a terminal)."""
    from stack.client import ServiceError, ServiceUnreachable

    completed, failed, total = _counts(batch)
    # Lines done before the wait began are its starting point, not progress made in no time.
    bar = progress_bar(desc=batch["id"], unit="line", total=total or None, initial=completed + failed)
    failures = 0
    try:
        while True:
            completed, failed, total = _counts(batch)
            bar.total, bar.n = total or None, completed + failed
            bar.set_postfix_str(f"{batch['status']}, {failed} failed", refresh=False)
            bar.refresh()
            if batch["status"] in ENDED:
                return batch
            time.sleep(POLL_SECONDS)
            try:
                batch = client.batch(batch["id"])
                failures = 0
            except (ServiceUnreachable, ServiceError) as err:
                if isinstance(err, ServiceError) and err.status < 500:
                    raise
                failures += 1
                if failures > WAIT_RETRIES:
                    raise
                note(f"llmq: {err}; polling again ({failures}/{WAIT_RETRIES})")
                time.sleep(min(POLL_SECONDS * 2 ** failures, 8.0))
    finally:
        bar.close()


def ended_code(batch: dict) -> int:
    """0 completed with every line, 3 completed with failed lines, 1 ended otherwise (or not ended)."""
    if batch["status"] != "completed":
        return NOT_COMPLETED
    return LINES_FAILED if batch["request_counts"]["failed"] else OK


def _write_results(client, batch: dict, args) -> int:
    """The batch's output and error files to -o and --errors (or stdout and stderr); the exit code."""
    errors_path = args.errors or (args.output.with_suffix(".errors.jsonl") if args.output else None)
    written = [_download(client, batch.get("output_file_id"), args.output, sys.stdout),
               _download(client, batch.get("error_file_id"), errors_path, sys.stderr)]
    completed, failed, total = _counts(batch)
    summary = f"{batch['id']} {batch['status']}: {completed} completed, {failed} failed of {total}"
    if args.output:
        note(f"{summary}\n  output: {written[0]}\n  errors: {written[1]}")
        if args.json:
            print_json(batch)
    else:
        note(summary)
    _print_batch_errors(batch)
    return ended_code(batch)


def _download(client, file_id: str | None, path: Path | None, stream) -> Path | None:
    """A result file to `path` (written even when the batch has none: empty), or to `stream`."""
    if path is None:
        if file_id:
            stream.flush()
            for chunk in client.file_content(file_id):  # bytes as they are: a chunk may end mid-character
                stream.buffer.write(chunk)
            stream.buffer.flush()
        return None
    partial = path.with_name(path.name + ".part")  # a download cut short never looks like a whole file
    try:
        with partial.open("wb") as out:
            for chunk in client.file_content(file_id) if file_id else ():
                out.write(chunk)
        partial.replace(path)
    except BaseException as err:
        partial.unlink(missing_ok=True)
        if not isinstance(err, OSError):
            raise
        raise UsageError(f"cannot write {str(path)!r}: {err.strerror or err}") from None
    return path.resolve()


def _print_batch_errors(batch: dict) -> None:
    """A batch that failed as a whole (its file could not be read, say) says why in `errors`."""
    for error in (batch.get("errors") or {}).get("data") or []:
        where = f" (line {error['line']})" if error.get("line") else ""
        note(f"  {error.get('code')}: {error.get('message')}{where}")


def _counts(batch: dict) -> tuple[int, int, int]:
    counts = batch["request_counts"]
    return counts["completed"], counts["failed"], counts["total"]


def _time(unix: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else "-"

