"""Fixtures the codec's unit tests share: the real tokenizer, the model's identity, and the fake backend
at the Backend seam (tests/codec_fakes.py). A test file may still define its own under the same name."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import FakeBackend, identity_for


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def identity(model_dir: Path) -> CodecIdentity:
    return identity_for(model_dir)


@pytest.fixture
def fake(identity: CodecIdentity) -> FakeBackend:
    """A backend that plays nothing until a test gives it a script."""
    return FakeBackend(identity.tokenizer_fingerprint)
