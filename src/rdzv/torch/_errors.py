"""rdzv's store errors as torch's: what torch code catches from a store, raised by TorchStore.

torch's stores raise ``torch.distributed.DistStoreError`` (a ``RuntimeError``) when a call times
out or fails, ``DistNetworkError`` when the server is unreachable and ``QueueEmptyError`` when a
non-blocking ``queue_pop`` finds nothing. An rdzv error that reaches torch code through
:class:`~rdzv.torch.TorchStore` is re-raised as a class derived from both its own class and
torch's, with the same message and attributes: ``except DistStoreError`` (torch's store barrier,
for one) and ``except StoreTimeoutError`` both catch it.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar, cast

import torch.distributed as dist

from .. import errors

F = TypeVar("F", bound=Callable[..., object])

_TORCH_CLASSES: tuple[tuple[type[errors.StoreError], type[Exception]], ...] = (
    (errors.QueueEmptyError, dist.QueueEmptyError),
    (errors.StoreConnectionError, dist.DistNetworkError),
    (errors.StoreError, dist.DistStoreError),
)
"""rdzv's store errors and the torch class each becomes, most specific first."""

_made: dict[type[errors.StoreError], type[errors.StoreError]] = {}
_made_lock = threading.Lock()


def torch_class(ours: type[errors.StoreError]) -> type[errors.StoreError]:
    """The class derived from ``ours`` and torch's class for it (made once per class)."""
    if issubclass(ours, dist.DistError):
        return ours
    with _made_lock:
        made = _made.get(ours)
        if made is None:
            theirs = next(t for o, t in _TORCH_CLASSES if issubclass(ours, o))
            # Named as rdzv's class (what messages and type names show); reachable for pickle
            # as the module attribute Torch<name> (unless a namesake from elsewhere has it).
            made = type(ours.__name__, (ours, theirs), {
                "__module__": __name__,
                "__qualname__": f"Torch{ours.__name__}",
                "__doc__": f"rdzv's {ours.__name__}, also torch's {theirs.__name__}.",
            })
            _made[ours] = made
            globals().setdefault(made.__qualname__, made)
        return made


def as_torch_error(exc: errors.StoreError) -> errors.StoreError:
    """``exc`` as an instance of :func:`torch_class` of its class: same message, attributes."""
    cls = torch_class(type(exc))
    if cls is type(exc):
        return exc
    twin = cls(*exc.args)  # (rdzv's errors take the message first, their extras optionally)
    twin.__dict__.update(exc.__dict__)
    return twin.with_traceback(exc.__traceback__)


def torch_errors(method: F) -> F:
    """Decorate a store method: the rdzv store errors it raises become torch's as well."""

    @functools.wraps(method)
    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return method(*args, **kwargs)
        except errors.StoreError as exc:
            raise as_torch_error(exc) from exc.__cause__

    return cast(F, wrapper)
