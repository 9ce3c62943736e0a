"""Builds every variant of every CPU kernel library ahead of time, so that a server needs no C
compiler at run time: ``python -m multiguess.engine.backends.cpu.build_kernels`` (the server
image does). Each library is otherwise built on first use (``bf16_kernel.open_library``)."""

from __future__ import annotations

import sys

from multiguess.engine.backends.cpu.bf16_kernel import BF16, build, find_compiler
from multiguess.engine.backends.cpu.quant_kernel import QUANT


def main() -> None:
    compiler = find_compiler()
    if compiler is None:
        sys.exit("no C compiler: install gcc or set CC")
    for sources in (BF16, QUANT):
        for name in sources.variants:
            print(build(compiler, name, sources))


if __name__ == "__main__":
    main()
