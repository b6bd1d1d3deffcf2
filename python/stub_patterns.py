#!/usr/bin/env python3
"""Writes nanobind stubgen's pattern file for ferry._ferry's exceptions (python/CMakeLists.txt).

The extension's exceptions say they belong to the package (`ferry.Error`, as tracebacks name
them), so stubgen would import them from `ferry`, which imports them from the extension: a cycle a
type checker cannot resolve. So each is declared by a pattern instead, written here from the built
module itself: its name, bases and docstring as python/src/errors.cpp made them (the one place
they are declared), and the attributes its docstring names ("Attributes: file, errno."), typed by
the table below, each declared on the first class that names it.
Usage: PYTHONPATH=<build>/python stub_patterns.py OUTPUT
"""
import os
import re
import sys

os.environ.setdefault("FERRY_ZYGOTE", "0")  # this import needs no worker processes
here = os.path.dirname(os.path.abspath(__file__))  # python/, whose ferry/ is the source: the built one is asked for
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
from ferry import _ferry  # noqa: E402

TYPES = {"worker": "int", "batch": "int", "file": "str", "offset": "int | None", "errno": "int"}


def named(cls: type) -> list:
    found = re.search(r"Attributes: ([\w, ]+)\.", cls.__doc__ or "")
    return [a.strip() for a in found.group(1).split(",")] if found else []


def main() -> None:
    lines = ["# Written by python/stub_patterns.py from the built ferry._ferry: do not edit."]
    for name, cls in vars(_ferry).items():
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            continue
        inherited = {a for base in cls.__mro__[1:] for a in named(base)}
        lines += [f"ferry\\._ferry\\.{name}$:", f"    class {name}({', '.join(b.__name__ for b in cls.__bases__)}):",
                  f'        """{cls.__doc__}"""']
        for attribute in named(cls):
            if attribute not in inherited:
                if attribute not in TYPES:
                    sys.exit(f"stub_patterns.py: {name}'s docstring names an attribute with no type here: {attribute}")
                lines.append(f"        {attribute}: {TYPES[attribute]}")
        lines.append("")
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
