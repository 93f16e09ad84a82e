"""Build of the two native extensions; the rest is in pyproject.toml.

- ``irdmafs._native`` (native/kernels.c): the PS kernels; numpy versions otherwise.
- ``irdmafs._engine`` (native/engine/): the data-plane engine; the Python transport otherwise.

Each is optional and built on its own, so one failed build never takes the other with it; what
runs instead is never silent: irdmafs/native.py and irdmafs/transport/engine.py say why, the
node and the mount log it at start and report it in their status (``irdmafs status``)."""

from setuptools import Extension, setup

# no fused multiply-add: every operation rounds to float32 as numpy's do, so the C and numpy
# kernels give the same bits
STRICT_FP = ["-O3", "-ffp-contract=off", "-fno-fast-math"]

setup(
    ext_modules=[
        Extension("irdmafs._native", ["native/kernels.c"], extra_compile_args=STRICT_FP, optional=True),
        Extension(
            "irdmafs._engine",
            ["native/engine/engine.c", "native/engine/frame.c"],
            include_dirs=["native/engine"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers", "-fno-strict-aliasing"],
            libraries=["pthread"],
            optional=True,
        ),
    ]
)
