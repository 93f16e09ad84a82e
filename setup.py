"""Build of the native kernels (native/kernels.c -> irdmafs._native); the rest is in pyproject.toml.

The extension is optional: without a C compiler irdmafs installs anyway and uses the numpy
versions of the same kernels (irdmafs/native.py says which one runs)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "irdmafs._native",
            ["native/kernels.c"],
            # no fused multiply-add: every operation rounds to float32 as numpy's do, so the C and
            # numpy kernels give the same bits
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
