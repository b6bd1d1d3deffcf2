#!/usr/bin/env python3
"""Every named note that a source or a doc cites (``Note [Name]``) is defined somewhere: a comment
line holding the note's name alone (``// Note [Name]`` or ``# Note [Name]``; the paragraph below
it is the note). The README's index of notes names every note defined, with its file.
Usage: notes_defined.py SOURCE_DIR (exit status 1 and the notes at fault otherwise)."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
globs = ["include/**/*.h", "src/*.h", "src/*.cpp", "dataloader/*.h", "dataloader/*.cpp", "loaders/*.h", "loaders/*.cpp",
         "pinning/*.h", "pinning/*.cpp", "pinning/*.cu", "collate/*.h", "collate/*.cpp", "python/src/*.cpp", "python/src/*.h",
         "python/ferry/*.py", "tools/**/*.cpp", "tests/**/*.cpp", "tests/**/*.py", "docs/*.md", "python/README.md",
         "README.md", "bench/RESULTS.md"]
cite = re.compile(r"Note \[([^\]]+)\]")
heading = re.compile(r"^\s*(?://|#)?\s*Note \[([^\]]+)\]\s*$")
cited, defined = {}, {}
for g in globs:
    for path in sorted(root.glob(g)):
        if path.name == "notes_defined.py":
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in cite.findall(line):
                cited.setdefault(name, f"{path.relative_to(root)}:{n}")
            m = heading.match(line)
            if m and path.suffix != ".md":
                defined.setdefault(m.group(1), str(path.relative_to(root)))
bad = False
for name, where in sorted(cited.items()):
    if name not in defined:
        print(f"Note [{name}], cited at {where}, is defined nowhere (a comment line holding only its name)")
        bad = True
readme = (root / "README.md").read_text()
for name, where in sorted(defined.items()):
    if f"Note [{name}]" not in readme:
        print(f"Note [{name}] ({where}) is missing from the README's index of notes")
        bad = True
if bad:
    sys.exit(1)
print(f"{len(defined)} notes, each defined and indexed in the README")
