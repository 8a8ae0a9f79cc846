"""Lazy re-exports for package roots: a public name's module is imported on first access.

Keeps ``import rdzv`` fast (the store server, the etcd client and the rendezvous engine pull in
asyncio, http.client and more) while ``rdzv.TCPStore`` and friends still work as plain names.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` for ``package`` serving ``exports``.

    ``exports`` maps a public name to the module (relative to ``package``) that defines it. The
    value is cached in ``namespace`` (the package's globals) after the first access.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
