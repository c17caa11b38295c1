"""Everything but the one compiled helper is declared in pyproject.toml.

cgcompile._address_check checks many tensors' data pointers in one call (cgcompile/csrc/address_check.cpp). It is
optional: without a C++ compiler the build goes on without it and cgcompile checks them in Python (slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cgcompile._address_check", ["cgcompile/csrc/address_check.cpp"],
                             extra_compile_args=["-O2"], language="c++", optional=True)])
