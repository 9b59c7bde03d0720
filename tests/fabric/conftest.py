import os

import pytest

if os.environ.get("TIERWISE_TEST_SCOPE"):
    # under tox the `frameworks` env installs them at their pinned versions: a missing one is an
    # error there, never a silent skip
    import lightning  # noqa: F401
else:
    pytest.importorskip("lightning", reason="needs tierwise[lightning]")
