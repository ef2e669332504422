"""The torch.compile backends the tests compare with eager: aot_eager, and inductor where a C++ compiler is."""

import shutil

import pytest

NO_CXX = shutil.which("g++") is None and shutil.which("gcc") is None
COMPILERS = [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(NO_CXX, reason="inductor needs a C++ compiler")),
]
