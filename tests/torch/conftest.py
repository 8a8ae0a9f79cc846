"""The torch tests run only where torch is installed; their processes start from ``_launcher``."""

import importlib.util

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]  # rdzv works without torch: nothing to test here
else:
    from _launcher import launcher  # noqa: F401  (the fixture)
