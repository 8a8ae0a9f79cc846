"""The torch tests run only where torch is installed; the helpers live in ``_torch_procs``."""

import importlib.util

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]  # rdzv works without torch: nothing to test here
else:
    from _torch_procs import procs  # noqa: F401  (the fixture)
