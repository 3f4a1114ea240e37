"""Command line of the development inference server (`rollserve dev-backend ...`).

    dev-backend make-tiny DIR                  write the tiny random Qwen3 model into DIR
    dev-backend [serve] [--model DIR] [--script FILE] [--host H] [--port P] ...

Serving without `--model` uses the tiny model at the configured `tiny_model_dir`, making it
first when it is missing or older than this version's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from routing.devserver.engine import DEFAULT_TEXT, DEFAULT_TURN_MARKER

log = logging.getLogger("rollserve.devserver")


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollserve dev-backend",
        description=(
            "Development inference server: vLLM's HTTP API (completions with token ids and "
            "logprobs, /inference/v1/generate, /tokenize, /detokenize, /metrics) and SGLang's "
            "native /generate and /abort_request, for a local model on the CPU, or scripted "
            "completions."
        ),
    )
    parser.add_argument("--model", type=Path, help="Hugging Face model directory (default: tiny)")
    parser.add_argument("--script", type=Path, help="JSONL script of scripted completions")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="model name of the API (default: dir name)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait per request")
    parser.add_argument(
        "--delay-max",
        type=float,
        default=None,
        help="with it, each request waits a uniformly drawn time from --delay to this",
    )
    parser.add_argument(
        "--unscored",
        action="store_true",
        help="scripted answers (--script, or --default-text) with made-up logprobs and no "
        "model loaded: a fast stand-in for load tests",
    )
    parser.add_argument("--default-text", default=DEFAULT_TEXT)
    parser.add_argument("--turn-marker", default=DEFAULT_TURN_MARKER)
    parser.add_argument("--chat-template", help="a Jinja chat template, or a file holding one")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the model (default 1: a small model gains nothing from more, "
        "and idle threads spinning beside other processes cost their CPU)",
    )
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY") or None,
        help="ask for this bearer token on every route but /health and /ping (default: "
        "$VLLM_API_KEY, as vLLM; pass it in the environment to keep it off the command line)",
    )
    return parser


def _default_model_dir() -> Path:
    from core.settings import get_settings

    return Path(get_settings().tiny_model_dir)


def _quiet_transformers() -> None:
    # Progress bars for a 40 MB model only clutter the server's log.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _keep_torch_caches_local() -> None:
    # Importing torch's compiler creates $TMPDIR/torchinductor_$USER; unless told otherwise,
    # keep that with rollserve's other working files.
    from core.settings import get_settings

    cache = Path(get_settings().data_dir) / "torchinductor"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache.resolve()))


def _make_tiny(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rollserve dev-backend make-tiny",
        description="Write a tiny random Qwen3 model with the real Qwen tokenizer.",
    )
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    from routing.devserver.tiny import is_complete, is_outdated, make_tiny_model

    if is_complete(args.dir):
        print(f"{args.dir}: already holds the tiny model")
        return 0
    if is_outdated(args.dir):
        print(f"{args.dir}: replacing an older tiny model")
    _keep_torch_caches_local()
    _quiet_transformers()
    started = time.monotonic()
    make_tiny_model(args.dir)
    print(f"{args.dir}: tiny model written in {time.monotonic() - started:.1f}s")
    return 0


def _serve(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    _keep_torch_caches_local()
    _quiet_transformers()

    import uvicorn

    from routing.devserver.app import create_app
    from routing.devserver.engine import Engine, ModelEngine, ScriptEngine, UnscoredScriptEngine
    from routing.devserver.tiny import make_tiny_model

    if args.threads < 1:
        print(f"--threads {args.threads}: give 1 or more", file=sys.stderr)
        return 2
    model_dir = args.model
    if model_dir is None:
        model_dir = make_tiny_model(_default_model_dir())
    if not model_dir.is_dir():
        print(f"--model {model_dir}: no such directory", file=sys.stderr)
        return 2
    chat_template = args.chat_template
    if chat_template is not None and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    common = {
        "served_model_name": args.served_model_name,
        "max_model_len": args.max_model_len,
        "delay": args.delay,
        "delay_max": args.delay_max,
        "chat_template": chat_template,
    }
    started = time.monotonic()
    engine: Engine
    if args.unscored:
        engine = UnscoredScriptEngine(
            model_dir,
            args.script,
            default_text=args.default_text,
            turn_marker=args.turn_marker,
            **common,
        )
    elif args.script is not None:
        engine = ScriptEngine(
            model_dir,
            args.script,
            default_text=args.default_text,
            turn_marker=args.turn_marker,
            **common,
        )
    else:
        engine = ModelEngine(model_dir, **common)
    engine.set_threads(args.threads)
    log.warning(
        "serving %s (%s engine, %s) on http://%s:%d, loaded in %.1fs",
        engine.served_model_name,
        engine.kind,
        model_dir,
        args.host,
        args.port,
        time.monotonic() - started,
    )
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who reaches it may use it", args.host)
    uvicorn.run(
        create_app(engine, api_key=args.api_key),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def main(argv: list[str]) -> int:
    """Run `make-tiny DIR` or the server; returns the exit status."""
    if argv[:1] == ["make-tiny"]:
        return _make_tiny(argv[1:])
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    return _serve(argv)
