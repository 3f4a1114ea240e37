"""Relays TCP connections on the box's loopback to the job's model endpoint, a Unix socket.

A box has no network: the host serves the job's endpoint on a Unix socket in a directory
bound into the box (`sandbox.endpointdir`). A harness that only speaks HTTP to a base URL runs
under this forwarder, inside the same box (each box has a loopback of its own):

    python -I -S llmforward.py --socket /rollserve/llm/endpoint.sock [--port N]
        [--url NAME=TEMPLATE ...] [-- COMMAND...]

It listens on 127.0.0.1:N (an ephemeral port by default), relays each connection both ways
to the socket (half-closes pass through: the side that ends its writing first still gets
the rest of the answer), and runs COMMAND with each `--url` variable set to TEMPLATE with
`{port}` replaced (`OPENAI_BASE_URL=http://127.0.0.1:{port}/v1`). It exits with COMMAND's
status (128+n when signal n ended it) once COMMAND ends; without COMMAND it relays until it
is killed. SIGTERM, SIGINT and SIGHUP are passed on to COMMAND. It exits with 125 when it
cannot listen (the port is taken) and 127 when COMMAND cannot be run.

Stdlib only, one event loop for every connection: the service's Python runs it inside boxes
with no site-packages, and it relays as many connections as the box may open.
"""

import argparse
import asyncio
import contextlib
import os
import signal
import sys

CHUNK = 1 << 16


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy `reader` to `writer` until its end, then end `writer`'s writing (a half-close)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()  # a reset on one side resets the other


async def relay(
    socket_path: str, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_unix_connection(socket_path)
    except OSError as exc:
        print(f"llmforward: cannot reach {socket_path}: {exc}", file=sys.stderr, flush=True)
        client_writer.transport.abort()
        return
    try:
        await asyncio.gather(
            pump(client_reader, upstream_writer), pump(upstream_reader, client_writer)
        )
    finally:
        for writer in (upstream_writer, client_writer):
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


async def serve(args: argparse.Namespace) -> int:
    # The loop holds tasks weakly: one whose sockets wait on nothing in the selector (both
    # paused) would be collected mid-relay, its connections cut.
    relays: set[asyncio.Task[None]] = set()

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(relay(args.socket, reader, writer))
        relays.add(task)
        task.add_done_callback(relays.discard)

    try:
        server = await asyncio.start_server(accepted, "127.0.0.1", args.port, backlog=512)
    except OSError as exc:
        print(
            f"llmforward: cannot listen on 127.0.0.1:{args.port}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 125
    port = server.sockets[0].getsockname()[1]
    if not args.command:
        async with server:
            await server.serve_forever()
        return 0
    env = dict(os.environ)
    for item in args.url:
        name, _, template = item.partition("=")
        env[name] = template.replace("{port}", str(port))
    try:
        child = await asyncio.create_subprocess_exec(*args.command, env=env)
    except OSError as exc:
        print(f"llmforward: cannot run {args.command[0]}: {exc}", file=sys.stderr, flush=True)
        return 127

    def pass_on(sig: int) -> None:
        if child.returncode is None:
            child.send_signal(sig)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, pass_on, sig)
    returncode = await child.wait()
    server.close()
    return exit_status(returncode)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmforward", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="the endpoint's Unix socket")
    parser.add_argument("--port", type=int, default=0, help="loopback port (0: any free one)")
    parser.add_argument("--url", action="append", default=[], metavar="NAME=TEMPLATE")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    for item in args.url:
        if "=" not in item:
            parser.error(f"--url needs NAME=TEMPLATE, not {item!r}")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
