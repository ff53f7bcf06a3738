"""Builds the optional C accelerator of the torch bridge's CPU path (``jaxlp.torch._cnoise``,
see jaxlp/torch/_cnoise.c); everything else is in pyproject.toml. Without a C compiler the
build of the extension is skipped (``optional=True``) and jaxlp runs its NumPy code instead."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("jaxlp.torch._cnoise", ["jaxlp/torch/_cnoise.c"], optional=True,
                             extra_compile_args=["-O2", "-ffp-contract=off"])])
