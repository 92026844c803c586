# The native parts are cffi API-mode extensions, compiled at install time.
from setuptools import setup

setup(cffi_modules=["native/build_shim.py:ffibuilder", "native/build_nft.py:ffibuilder"])
