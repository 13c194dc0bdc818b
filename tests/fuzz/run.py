"""Coverage-guided fuzzing of one parser with atheris (libFuzzer): ``run.py TARGET SECONDS [WORKDIR]``.

The seed corpus (tests/fuzz/corpus/TARGET/) is copied into WORKDIR (default: a temporary
directory) and the fuzzer's finds go there, so the committed corpus only changes by hand. A crash
(any exception the target does not allow, see tests/fuzz/targets.py) stops the run with exit
status 1 and leaves the input as WORKDIR/crash-*; add it to the corpus with the fix.
Without atheris (not built for this Python) it falls back to hypothesis for the same time.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def main() -> int:
    name, seconds = sys.argv[1], int(sys.argv[2])
    work = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp(prefix=f"uomp-fuzz-{name}-"))
    os.environ["UOMP_FUZZ_WORK"] = str(work)  # the targets' scratch files go there too (tests/fuzz/targets.py)
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for f in (HERE / "corpus" / name).glob("*"):
        shutil.copy(f, corpus / f.name)
    try:
        import atheris
    except ImportError:
        return _hypothesis(name, seconds)
    with atheris.instrument_imports(include=["gateway"]):  # only our code: instrumenting all is slow
        from targets import TARGETS
    target = TARGETS[name]
    sys.stdout.flush()
    atheris.Setup(
        [
            sys.argv[0],
            str(corpus),
            f"-max_total_time={seconds}",
            "-print_final_stats=1",
            "-rss_limit_mb=1024",
            "-timeout=10",
            f"-artifact_prefix={work}/",
            "-max_len=4096",
        ],
        target,
    )
    atheris.Fuzz()
    return 0


def _hypothesis(name: str, seconds: int) -> int:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from targets import TARGETS

    target = TARGETS[name]
    count = 0
    start = time.monotonic()

    @settings(max_examples=10**9, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=4096))
    def run(data: bytes) -> None:
        nonlocal count
        count += 1
        target(data)
        if time.monotonic() - start > seconds:
            raise _Done

    class _Done(Exception):
        pass

    try:
        run()
    except _Done:
        pass
    elapsed = time.monotonic() - start
    print(f"stat::number_of_executed_units: {count}\nstat::elapsed_seconds: {elapsed:.1f} (hypothesis)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
