"""The `llmq` client's own pieces, without a service: where the URL and key come from, and the SSE
reader on exact bytes (cut anywhere, as a network cuts them)."""
from __future__ import annotations

import pytest

from stack.client import ServiceError
from stack.client_config import ClientConfig, ConfigError, resolve_client_config, service_root
from stack.sse_reader import SSEEvent, SSEReader

ALL_SET = {"LLMQ_URL": "http://llmq:1", "OPENAI_BASE_URL": "http://openai:2/v1", "PORT": "3",
           "LLMQ_API_KEY": "llmq-key", "OPENAI_API_KEY": "openai-key"}


# ---- where the service and the key come from ---------------------------------------------------

def test_flags_win_over_every_environment_name():
    config = resolve_client_config("http://flag:9", "flag-key", ALL_SET)
    assert config == ClientConfig("http://flag:9", "flag-key", "--url")


def test_llmq_names_win_over_openai_names():
    assert resolve_client_config(None, None, ALL_SET) == ClientConfig("http://llmq:1", "llmq-key", "LLMQ_URL")


def test_openai_names_are_honoured_when_llmq_names_are_unset():
    environ = {"OPENAI_BASE_URL": "http://openai:2/v1", "OPENAI_API_KEY": "openai-key", "PORT": "3"}
    assert resolve_client_config(None, None, environ) == ClientConfig("http://openai:2", "openai-key",
                                                                      "OPENAI_BASE_URL")


def test_the_default_is_the_local_service_on_port():
    assert resolve_client_config(None, None, {}) == ClientConfig("http://127.0.0.1:8000", None, "PORT")
    assert resolve_client_config(None, None, {"PORT": "8123"}).url == "http://127.0.0.1:8123"


def test_an_empty_variable_counts_as_unset():
    environ = {"LLMQ_URL": "", "OPENAI_BASE_URL": "http://openai:2", "LLMQ_API_KEY": "", "OPENAI_API_KEY": "k"}
    assert resolve_client_config(None, "", environ) == ClientConfig("http://openai:2", "k", "OPENAI_BASE_URL")


def test_url_and_key_are_resolved_independently():
    config = resolve_client_config(None, None, {"OPENAI_BASE_URL": "http://openai:2/v1", "LLMQ_API_KEY": "llmq-key"})
    assert (config.url, config.api_key) == ("http://openai:2", "llmq-key")


@pytest.mark.parametrize("url", ["http://host:8000", "http://host:8000/", "http://host:8000/v1", "http://host:8000/v1/",
                                 " http://host:8000/v1 "])
def test_a_url_with_or_without_v1_names_the_same_service(url):
    assert service_root(url) == "http://host:8000"


def test_a_path_prefix_before_v1_is_kept():
    assert service_root("https://proxy.example/llmq/v1") == "https://proxy.example/llmq"
    assert service_root("https://proxy.example/v1beta") == "https://proxy.example/v1beta"


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host", "http://", ""])
def test_a_url_that_is_not_http_is_refused_naming_its_source(url):
    with pytest.raises(ConfigError, match="LLMQ_URL must be an http:// or https:// URL"):
        resolve_client_config(None, None, {"LLMQ_URL": url or " "})


@pytest.mark.parametrize("port", ["eighty", "0", "70000"])
def test_a_bad_port_is_refused(port):
    with pytest.raises(ConfigError, match="PORT must be a port number"):
        resolve_client_config(None, None, {"PORT": port})


def test_a_service_error_reads_as_status_code_and_message():
    assert str(ServiceError(401, "Incorrect API key provided", "invalid_api_key")) == \
        "401 invalid_api_key: Incorrect API key provided"
    assert str(ServiceError(502, "Bad Gateway")) == "502: Bad Gateway"


# ---- the SSE reader ------------------------------------------------------------------------------

# What the service writes: a heartbeat comment, then events with ids (app/sse.py), one with two data lines.
STREAM = (b": keep-alive\n\n"
          b"id: 0-1\nevent: delta\ndata: {\"text\": \"caf\xc3\xa9\"}\n\n"
          b"id: 0-2\nevent: delta\ndata: line one\ndata: line two\n\n"
          b"id: 0-3\nevent: done\ndata: {}\n\n")
EXPECTED = [SSEEvent("delta", '{"text": "café"}', "0-1"), SSEEvent("delta", "line one\nline two", "0-2"),
            SSEEvent("done", "{}", "0-3")]


def test_a_whole_stream_at_once():
    assert SSEReader().feed(STREAM) == EXPECTED


def test_the_same_events_however_the_bytes_are_cut():
    for cut in range(1, len(STREAM)):  # every split point, inside a UTF-8 character and a line end too
        reader = SSEReader()
        assert reader.feed(STREAM[:cut]) + reader.feed(STREAM[cut:]) == EXPECTED, cut
    reader = SSEReader()
    assert list(reader.events(bytes([b]) for b in STREAM)) == EXPECTED  # a byte at a time


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"])
def test_every_line_ending(end):
    stream = STREAM.replace(b"\n", end)
    assert SSEReader().feed(stream) == EXPECTED
    reader = SSEReader()
    assert list(reader.events(bytes([b]) for b in stream)) == EXPECTED


def test_an_event_is_received_only_once_its_blank_line_has_come():
    reader = SSEReader()
    assert reader.feed(b"id: 0-1\ndata: a\n\nid: 0-2\ndata: b\n") == [SSEEvent("message", "a", "0-1")]
    # The connection drops here: 0-2 was never dispatched, so a resume asks for what follows 0-1.
    assert reader.last_event_id == "0-2"  # the id line came, but the event that resumes is the last dispatched


def test_the_last_event_id_stays_until_changed_and_an_empty_id_resets_it():
    events = SSEReader().feed(b"id: 7\ndata: a\n\ndata: b\n\nid\ndata: c\n\n")
    assert [e.id for e in events] == ["7", "7", None]


def test_field_rules():
    events = SSEReader().feed(b"\xef\xbb\xbfdata:no space\n\n"  # a BOM at the start is skipped
                              b"data:  two spaces\n\n"  # only one space after the colon is dropped
                              b"data\n\n"  # a field with no colon has an empty value
                              b"event: x\n\n"  # no data: nothing dispatched, and the type does not carry over
                              b"retry: 10\nfoo: bar\ndata: y\n\n"  # unknown fields are ignored
                              b"id: a\0b\ndata: z\n\n"  # an id with NUL is ignored
                              b"data: cut off")  # never finished: never dispatched
    assert events == [SSEEvent("message", "no space", None), SSEEvent("message", " two spaces", None),
                      SSEEvent("message", "", None), SSEEvent("message", "y", None),
                      SSEEvent("message", "z", None)]


@pytest.mark.parametrize("argv, url, as_json", [
    (["batch", "list"], None, False),
    (["--url", "http://a:1", "--json", "batch", "list"], "http://a:1", True),
    (["batch", "list", "--url", "http://b:2", "--json"], "http://b:2", True),
    (["--url", "http://a:1", "batch", "list", "--url", "http://b:2"], "http://b:2", False),  # the command's wins
    (["--api-key", "llmq-x", "requests", "tail", "req_1"], None, False),
])
def test_connection_options_go_before_the_command_or_after_it(argv, url, as_json):
    from stack.cli import build_parser

    args = build_parser().parse_args(argv)
    assert (args.url, args.json) == (url, as_json)
    assert args.api_key == ("llmq-x" if "--api-key" in argv else None)
