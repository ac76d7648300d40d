"""Every C++ file of kernels/cpu_ops is compiled and in the build's digest: a kernel file
kernels.cpp did not include would be missing from the module, and a file outside the
digest could change without a rebuild (a stale module loaded for new source)."""
from __future__ import annotations

import re

from kernels.cpu_ops import build


def test_every_kernel_file_is_in_the_one_unit_and_every_file_in_the_digest():
    files = {p.name for p in build.HERE.glob("*.cpp")} | {p.name for p in build.HERE.glob("*.h")}
    digested = {p.name for p in build.SOURCES + build.HEADERS}
    assert files == digested, files ^ digested
    unit = (build.HERE / "kernels.cpp").read_text()
    included = set(re.findall(r'^#include "(\w+\.cpp)"', unit, re.M))
    assert included == {p.name for p in build.KERNELS}
    compiled = {p.name for p in build.SOURCES}
    assert compiled == {"kernels.cpp", "bind.cpp"}, compiled
    assert not compiled & included
