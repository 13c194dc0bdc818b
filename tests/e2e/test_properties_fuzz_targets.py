"""Every parser's fuzz target (tests/fuzz/targets.py) under hypothesis, bounded.

The same targets run coverage-guided under atheris in scripts/fuzz.sh. Here each gets arbitrary
bytes plus its committed seed corpus (tests/fuzz/corpus/<name>/), so a crash the fuzzer found once
stays a regression test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shortdir import short_dir

# the targets' scratch files in a directory the session removes (an atexit clean-up would run after
# the session's check for leftovers)
os.environ.setdefault("UOMP_FUZZ_WORK", str(short_dir("uomp-fuzz-")))
sys.path.insert(0, str(Path(__file__).parents[1] / "fuzz"))
from targets import TARGETS

CORPUS = Path(__file__).parents[1] / "fuzz" / "corpus"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seed_corpus(name: str) -> None:
    files = sorted((CORPUS / name).glob("*"))
    assert files, f"no seed corpus for {name}"
    for f in files:
        TARGETS[name](f.read_bytes())


@pytest.mark.parametrize("name", sorted(TARGETS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=600))
def test_target_holds_on_any_bytes(name: str, data: bytes) -> None:
    TARGETS[name](data)
