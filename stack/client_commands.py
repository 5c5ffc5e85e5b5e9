"""What every `llmq` command that calls the service shares: its connection options, its exit codes,
errors in words (never a traceback), --json output, and progress bars that keep quiet off a terminal.

Exit codes (the same for every client command; `llmq batch run`, offline, uses 0, 2 and 3 alike):
    0  success
    1  the batch or request ended but not completed (failed, cancelled, expired; an error event), or
       `batch results` of a batch that has not ended
    2  usage or bad input: a bad option, a file that cannot be read, or the API refused the call (4xx)
    3  the batch completed but some of its lines failed (their errors are in the errors file)
    4  the service cannot be reached, the connection was lost past its retries, or it answered 5xx
  130  interrupted (Ctrl-C)
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys

OK, NOT_COMPLETED, USAGE, LINES_FAILED, UNREACHABLE, INTERRUPTED = 0, 1, 2, 3, 4, 130


class UsageError(Exception):
    """Bad input the user can fix: the message says how."""


def connection_options(top_level: bool = False) -> argparse.ArgumentParser:
    """The options every client command takes (an argparse parent parser), before the command's name
    or after it: `llmq --url U batch list` and `llmq batch list --url U` alike. The top level's set the
    defaults; a command's own are only there when given (SUPPRESS), so they win without hiding the
    top level's."""
    default = None if top_level else argparse.SUPPRESS
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("service")
    group.add_argument("--url", default=default, help="the service, e.g. http://127.0.0.1:8000 (with or without /v1); default: "
                                     "$LLMQ_URL, else $OPENAI_BASE_URL, else http://127.0.0.1:$PORT (8000)")
    group.add_argument("--api-key", default=default, help="an API key (llmq-...); default: $LLMQ_API_KEY, else $OPENAI_API_KEY, "
                                         "else none (an open install needs none)")
    group.add_argument("--json", action="store_true", default=False if top_level else argparse.SUPPRESS,
                       help="print the API's objects as JSON on stdout")
    return options


def connect(args):
    """A client of the service that the options and the environment name."""
    from stack.client import LlmqClient
    from stack.client_config import resolve_client_config

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per call on the user's terminal
    config = resolve_client_config(args.url, args.api_key, os.environ)
    return LlmqClient(config.url, config.api_key)


def client_command(func):
    """A command function whose failures become a message on stderr and one of the exit codes above."""
    @functools.wraps(func)
    def run(args) -> int:
        from stack.client import ServiceError, ServiceUnreachable
        from stack.client_config import ConfigError

        try:
            return func(args)
        except ServiceError as err:
            return fail(str(err), UNREACHABLE if err.status >= 500 else USAGE)
        except ServiceUnreachable as err:
            return fail(str(err), UNREACHABLE)
        except (ConfigError, UsageError) as err:
            return fail(str(err), USAGE)
        except KeyboardInterrupt:
            return fail("interrupted", INTERRUPTED)
        except BrokenPipeError:  # `llmq batch results ID | head`: the reader has what it wanted
            # Python would complain writing the rest at exit; send it nowhere instead (as its docs advise).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return OK
    return run


def fail(message: str, code: int) -> int:
    print(f"llmq: error: {message}", file=sys.stderr)
    return code


def note(message: str) -> None:
    """What a person at the terminal wants to know, kept off stdout (which may feed a script)."""
    print(message, file=sys.stderr)


def print_json(obj) -> None:
    print(json.dumps(obj), flush=True)


def progress_bar(**kwargs):
    """A tqdm bar on stderr, disabled when stderr is not a terminal (a log file, a pipe, CI)."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, disable=not sys.stderr.isatty(), **kwargs)


def write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
