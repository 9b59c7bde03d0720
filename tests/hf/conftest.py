import os

import pytest

if os.environ.get("TIERWISE_TEST_SCOPE"):
    # under tox (and .ci/run) the env installs tierwise[test], which brings transformers and
    # peft: a missing one is an error there, never a silent skip of the integration tests
    import peft  # noqa: F401
    import transformers  # noqa: F401
else:
    pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers")
