"""Everything but the compiled helpers is declared in pyproject.toml.

Four optional C++ extensions, none built against torch's headers (they reach torch through Python callables and
one C function torch exports), so they build wherever CPython's headers and a C++ compiler are: without a compiler
the build goes on without them and cgcompile runs the same checks in Python (slower).

- cgcompile._address_check checks many tensors' data pointers in one call (cgcompile/csrc/address_check.cpp).
- cgcompile._steady_replay is the steady copy-out replay of a frame that is one partition call
  (cgcompile/csrc/steady_replay.cpp; runtime/local/steady.py arms it).
- cgcompile._scope_gate is a frame's capture-scope look-up (cgcompile/csrc/scope_gate.cpp; scope.py's ScopedFrame).
- cgcompile._serialized_call calls a compiled frame holding its runtime's lock (cgcompile/csrc/serialized_call.cpp;
  runtime/local/serialized.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("cgcompile._address_check", ["cgcompile/csrc/address_check.cpp"], extra_compile_args=["-O2"],
              language="c++", optional=True),
    Extension("cgcompile._steady_replay", ["cgcompile/csrc/steady_replay.cpp"], extra_compile_args=["-O2"],
              depends=["cgcompile/csrc/callable_type.h"], language="c++", optional=True),
    Extension("cgcompile._scope_gate", ["cgcompile/csrc/scope_gate.cpp"], extra_compile_args=["-O2"],
              depends=["cgcompile/csrc/callable_type.h"], language="c++", optional=True),
    Extension("cgcompile._serialized_call", ["cgcompile/csrc/serialized_call.cpp"], extra_compile_args=["-O2"],
              depends=["cgcompile/csrc/callable_type.h"], language="c++", optional=True),
])
