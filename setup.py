from setuptools import setup

# Everything else is in pyproject.toml; this file only hooks the cffi extensions into the build.
setup(cffi_modules=["offload/_build.py:ffibuilder", "offload/_build.py:kernels"])
