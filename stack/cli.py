"""The `llmq` command line.

Offline, on this machine's engine (no service needed):
    llmq generate [--model DIR] "Once upon a time"     stream a completion to the terminal
    llmq batch run IN.jsonl OUT.jsonl [--model DIR]     offline bulk job on OpenAI batch lines (resumable)
    llmq demo [--offline]                               a real bulk job end to end on the embedded defaults
    llmq serve [--workers N] [--port P]                 the whole service here until Ctrl-C (the dashboard at /dashboard)
    llmq default-model                                  print (and make, once) the default model's folder

Administration, on the database of DATABASE_URL and the fleet:
    llmq keys create|list|revoke                        API keys and their tenants (stack/keys_cli.py)
    llmq autoscale [--replay synthetic --plot f.png]    size the workers from the queues (stack/autoscale_cli.py)

A running service, over its HTTP API (--url / LLMQ_URL, --api-key / LLMQ_API_KEY; stack/client_cli.py):
    llmq batch submit IN.jsonl [--wait -o OUT.jsonl]    upload a batch file, create the batch, follow it
    llmq batch list | status ID [--wait] | results ID [-o OUT.jsonl] | cancel ID
    llmq complete "Once upon a time" [--stream]         one completion (POST /v1/completions)
    llmq requests tail REQUEST_ID                       follow a request's text, resuming after a dropped connection

Exit codes: 0 success; 1 a batch or request ended not completed; 2 usage, bad input or the API's 4xx;
3 some batch lines failed (`batch run` too); 4 the service unreachable or its 5xx
(stack/client_commands.py). Progress bars go to stderr, and only when it is a terminal.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from llmq.bootstrap import default_model_path, llmq_home


def _make_engine(args):
    from llmq.engine.config import EngineConfig
    from llmq.engine.llm import LLMEngine

    model = Path(args.model) if args.model else default_model_path()
    config = EngineConfig(model=str(model), device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads or None,
                          quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          **({"kv_cache_bytes": args.kv_cache_bytes} if args.kv_cache_bytes else {}))
    return LLMEngine(config), model


def cmd_generate(args) -> int:
    from llmq.sampling_params import SamplingParams

    engine, _ = _make_engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or (), ignore_eos=args.ignore_eos)
    engine.add_request("cli", args.prompt, params)
    sys.stdout.write(args.prompt)
    reason = None
    try:
        while engine.has_unfinished():
            for delta in engine.step():
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                reason = delta.finish_reason or reason
    finally:
        engine.close()
    sys.stdout.write("\n")
    print(f"[finish_reason: {reason}]", file=sys.stderr)
    return 0


def cmd_batch_run(args) -> int:
    from llmq.batch_runner import run_batch_file

    if not Path(args.input).is_file():  # said before the engine takes its seconds to load
        raise ValueError(f"cannot read the batch input file {args.input!r}: no such file")
    engine, model = _make_engine(args)
    try:
        summary = run_batch_file(engine, args.input, args.output, args.errors, model_name=args.model_name or model.name,
                                 progress=sys.stderr.isatty())  # no bar in a log file or a pipe
    finally:
        engine.close()
    print(json.dumps({"output": str(Path(args.output).resolve()), **summary.__dict__}))
    return 0 if summary.failed == 0 else 3


def cmd_demo(args) -> int:
    if args.offline:
        return _offline_demo(args)
    from stack.demo import run_demo

    return run_demo(llmq_home())


def _offline_demo(args) -> int:
    """The same bulk job through the offline runner: no Redis, no database, no HTTP."""
    from llmq.batch_runner import run_batch_file
    from stack.demo import DEMO_PROMPTS, demo_lines

    demo_dir = llmq_home() / "demo-offline"
    demo_dir.mkdir(parents=True, exist_ok=True)
    input_path, output_path = demo_dir / "input.jsonl", demo_dir / "output.jsonl"
    errors_path = demo_dir / "output.errors.jsonl"
    engine, model = _make_engine(args)
    input_path.write_text("\n".join(demo_lines(model.name)) + "\n")
    for stale in (output_path, errors_path):
        stale.unlink(missing_ok=True)
    summary = run_batch_file(engine, input_path, output_path, errors_path, model_name=model.name,
                             progress=sys.stderr.isatty())
    print(f"{summary.completed} completed, {summary.failed} failed, {summary.completion_tokens} tokens "
          f"in {summary.seconds:.1f} s\nresults: {output_path}\nerrors:  {errors_path}")
    return 0 if summary.completed == len(DEMO_PROMPTS) and summary.failed == 1 else 1


def cmd_serve(args) -> int:
    from stack.serve import serve

    return serve(args.workers, args.port)


def cmd_default_model(args) -> int:
    print(default_model_path())
    return 0


def _add_engine_arguments(parser) -> None:
    parser.add_argument("--model", help="Hugging Face model folder (default: $MODEL_PATH or llmq's own small model)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="compute dtype (auto: bfloat16 on a CPU that computes it natively, else float32; "
                             "the checkpoint's on a GPU)")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, help="KV cache size in bytes (default: 1 GiB on a CPU, gpu_memory_utilization on a GPU)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (per rank)")
    parser.add_argument("--quantization", choices=("int8", "int4"), help="quantize the weights at load")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks that split every layer")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="ranks that each hold a run of layers")


def build_parser() -> argparse.ArgumentParser:
    from stack.client_commands import connection_options  # torch-free, like everything here at parse time

    parser = argparse.ArgumentParser(prog="llmq", description="llmq: batch LLM inference",
                                     parents=[connection_options(top_level=True)])
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only (not the memory budget)")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream one completion to the terminal")
    _add_engine_arguments(generate)
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.set_defaults(func=cmd_generate)

    batch = commands.add_parser("batch", help="bulk jobs: offline (run) or on the service (submit, list, status, "
                                              "results, cancel)").add_subparsers(dest="batch_command", required=True)
    run = batch.add_parser("run", help="run an OpenAI batch input file (JSONL) to an output file; resumable")
    _add_engine_arguments(run)
    run.add_argument("input")
    run.add_argument("output")
    run.add_argument("--errors", help="error lines go here (default: OUTPUT with .errors.jsonl)")
    run.add_argument("--model-name", help="the model name written into each response")
    run.set_defaults(func=cmd_batch_run)

    demo = commands.add_parser("demo", help="a real bulk job end to end: Redis, SQLite, a Celery worker, HTTP")
    _add_engine_arguments(demo)
    demo.add_argument("--offline", action="store_true", help="run the job through the offline runner instead")
    demo.set_defaults(func=cmd_demo)

    serve = commands.add_parser("serve", help="the whole service here until Ctrl-C: Redis, workers, the API, the dashboard")
    serve.add_argument("--workers", type=int, default=1, help="Celery worker processes (one engine each)")
    serve.add_argument("--port", type=int, help="the web server's port (default: $PORT or 8000)")
    serve.set_defaults(func=cmd_serve)

    default = commands.add_parser("default-model", help="print the default model's folder, making it once")
    default.set_defaults(func=cmd_default_model)

    from stack.autoscale_cli import add_autoscale_command  # torch-free, like everything here at parse time
    from stack.client_cli import add_client_commands
    from stack.keys_cli import add_keys_command

    add_keys_command(commands)
    add_autoscale_command(commands)
    add_client_commands(commands, batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as err:  # a bad model folder or request: say what, not a traceback
        print(f"llmq: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
