import pytest

pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers")
