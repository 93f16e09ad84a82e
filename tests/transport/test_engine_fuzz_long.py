"""The engine's long native checks (``@pytest.mark.long``: only with scripts/test --long,
IRDMAFS_LONG=1, as CI runs them):

- scripts/fuzz 120: libFuzzer with ASan and UBSan over the frame parser
  (native/engine/fuzz_frame.c over frame.c) for two minutes, from the seed corpus;
- scripts/sanitize: the engine built with ASan and UBSan, and ``tests/transport -k engine``
  run against it (this file excluded); the PS kernels (native/kernels.c) so built, and their
  tests and the round's run against them.

Both install clang-14 and libclang-rt-14-dev when missing and exit 77 when they cannot; the tests
skip then, with the script's reason. Any crash, sanitizer report or failed test fails them, with
the script's output.
"""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NO_TOOLCHAIN = 77  # scripts/fuzz and scripts/sanitize: clang-14 cannot be installed or found

pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(os.environ.get("IRDMAFS_SANITIZE_RUN") == "1", reason="already inside scripts/sanitize's run"),
]


def run(args, timeout):
    proc = subprocess.run(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if proc.returncode == NO_TOOLCHAIN:
        pytest.skip(f"{args[0]}: no clang-14 toolchain: {proc.stdout.strip()[-500:]}")
    return proc


def test_two_minutes_of_libfuzzer_over_the_frame_parser_find_no_crash():
    proc = run(["scripts/fuzz", "120"], timeout=600)
    assert proc.returncode == 0, f"scripts/fuzz 120 exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    assert "no crash in 120 s" in proc.stdout, proc.stdout[-2000:]


def test_the_engine_tests_pass_under_address_and_undefined_behaviour_sanitizers():
    proc = run(["scripts/sanitize", "tests/transport", "-k", "engine and not fuzz_long"], timeout=900)
    assert proc.returncode == 0, f"scripts/sanitize exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    assert "build/asan/irdmafs/_engine" in proc.stdout  # the sanitized build was the one imported
    assert "no sanitizer report" in proc.stdout, proc.stdout[-2000:]


def test_the_kernels_tests_pass_under_address_and_undefined_behaviour_sanitizers():
    """The PS kernels (native/kernels.c: the round's sums, the optimizers) under ASan and UBSan,
    through their own tests and the round's (UBSan found a misaligned gradient read there)."""
    tests = ["tests/unit/test_native.py", "tests/unit/test_sums.py", "tests/unit/test_training.py", "tests/unit/test_push_ids.py"]
    proc = run(["scripts/sanitize", *tests], timeout=900)
    assert proc.returncode == 0, f"scripts/sanitize exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    assert "build/asan/irdmafs/_native" in proc.stdout  # the sanitized kernels were the ones imported
    assert "no sanitizer report" in proc.stdout, proc.stdout[-2000:]
