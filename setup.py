from setuptools import setup

# Everything else is in pyproject.toml; this file only hooks the cffi extension into the build.
setup(cffi_modules=["offload/_build.py:ffibuilder"])
