"""``rdzv.server.protocol``, the first name of the store's wire protocol: it lives in
:mod:`rdzv.kv.protocol`, the floor below both the server and the TCP client."""

from __future__ import annotations

from ..kv.protocol import *  # noqa: F401,F403
