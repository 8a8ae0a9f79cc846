"""A child process holding its own client of a store, driven by JSON lines on stdin.

Run as ``python _child.py '<spec>'`` where spec is ``{"factory": "module:callable", "kwargs":
{...}}`` and optionally ``"prefix": "p"`` (the client is then ``PrefixStore(p, client)``). The
child prints ``{"ready": true}`` once its client is open, then reads one request per line,
``{"op": "set", "args": [...], "kwargs": {...}}``, calls that method of its client and prints
``{"result": ...}`` or ``{"error": "<exception type>", "message": "..."}``. Bytes travel as
``{"b64": "..."}``. The extra ops ``add_many(key, amount, count)`` (adds ``count`` times)
and ``pop_many(key, count)`` (pops ``count`` items of a queue) return every result. End of input closes the client and exits.
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import sys
from typing import Any, Callable

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def encode(value: Any) -> Any:
    """A JSON-able form of a store result or argument (bytes become ``{"b64": ...}``)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, dict):
        if set(value) == {"b64"}:
            return base64.b64decode(value["b64"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def load_factory(target: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:callable"``."""
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"factory {target!r} must look like 'package.module:callable'")
    return getattr(importlib.import_module(module_name), attr)


def open_client(spec: dict[str, Any]) -> Any:
    """The client that ``spec`` describes."""
    client = load_factory(spec["factory"])(**spec.get("kwargs", {}))
    if spec.get("prefix"):
        from rdzv.store import PrefixStore

        client = PrefixStore(spec["prefix"], client)
    return client


def add_many(client: Any, key: str, amount: int, count: int) -> list[int]:
    return [client.add(key, amount) for _ in range(count)]


def pop_many(client: Any, key: str, count: int) -> list[bytes]:
    return [client.queue_pop(key) for _ in range(count)]


EXTRA_OPS: dict[str, Callable[..., Any]] = {"add_many": add_many, "pop_many": pop_many}
"""Ops beyond the client's methods: loops run inside the peer."""


def call_op(client: Any, op: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Run request ``op`` on ``client``: an extra op, or the client's method of that name."""
    extra = EXTRA_OPS.get(op)
    if extra is not None:
        return extra(client, *args, **kwargs)
    return getattr(client, op)(*args, **kwargs)


def serve(client: Any) -> None:
    """Answer requests from stdin until it closes."""
    for line in sys.stdin:
        request = json.loads(line)
        op, args, kwargs = request["op"], decode(request.get("args", [])), request.get("kwargs", {})
        try:
            result = call_op(client, op, args, decode(kwargs))
            reply = {"result": encode(result)}
        except Exception as exc:  # reported to the parent, which asserts on it
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)


def prepare() -> None:
    """What a child needs before its spec: the import paths, logging."""
    sys.path.insert(0, REPO_ROOT)
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # the shared test helpers (_waiting...)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def main() -> None:
    prepare()
    serve_spec(json.loads(sys.argv[1]))


def serve_spec(spec: dict[str, Any]) -> None:
    """Open the client ``spec`` names, say it is ready, answer requests until stdin closes."""
    client = open_client(spec)
    print(json.dumps({"ready": True}), flush=True)
    try:
        serve(client)
    finally:
        client.close()
        underlying = getattr(client, "underlying_store", None)
        if underlying is not None:
            underlying.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # its client is closed: skip the interpreter's teardown (seconds with torch loaded)
