"""A client process of an etcd cluster for fail-over tests, reporting on stdout as JSON lines.

``python _etcd_peer.py '<json>'`` with ``{"endpoints": [...], "prefix": "...", "op": ...}``:

* ``"op": "write", "name": n, "count": c`` sets ``n/0`` .. ``n/<c-1>`` one after another and
  prints ``{"acked": i}`` after each write returns;
* ``"op": "get", "key": k`` prints ``{"ready": true}`` and then ``{"value": "<value>"}`` once
  ``get(k)`` returns.

Errors print ``{"error": "<type>", "message": "..."}`` and exit with status 1.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

from rdzv.store import EtcdStore  # noqa: E402


def emit(message: dict) -> None:
    print(json.dumps(message), flush=True)


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        store = EtcdStore(
            spec["endpoints"],
            prefix=spec["prefix"],
            timeout=120,
            request_timeout=3,
            retry_timeout=60,
        )
        with store:
            if spec["op"] == "write":
                for i in range(spec["count"]):
                    store.set(f"{spec['name']}/{i}", str(i))
                    emit({"acked": i})
            else:
                emit({"ready": True})
                emit({"value": store.get(spec["key"]).decode()})
    except Exception as exc:  # reported to the test, which fails with it
        emit({"error": type(exc).__name__, "message": str(exc)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
