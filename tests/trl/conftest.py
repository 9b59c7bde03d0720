import os

import pytest

if os.environ.get("TIERWISE_TEST_SCOPE"):
    # under tox the `frameworks` env installs them at their pinned versions: a missing one is an
    # error there, never a silent skip
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import trl  # noqa: F401
else:
    pytest.importorskip("trl", reason="needs tierwise[trl]")
    pytest.importorskip("datasets", reason="needs tierwise[trl]")
    pytest.importorskip("peft", reason="needs tierwise[trl]")
