"""The op census of a compiled program: how many of each op it launches, which the bench prints for its
compiled train step.

  counts = census(compiled.as_text())     # a Counter by op name: fusion, custom-call, copy, while, ...
"""

import collections
import re


def census(hlo: str) -> collections.Counter:
    """How many of each op a compiled program (`compiled.as_text()`) launches: the ops of its entry and of
    the loops, calls and branches it runs (each body counted once, not per iteration), not what is
    inside a fusion. A fusion, a library call (`custom-call`: cuBLAS, cuDNN, a Pallas kernel) or a copy
    is each a kernel on a GPU; copies of whole parameters there say that an update was not done in place."""
    bodies, current = {}, None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            current = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            bodies[current] = []
        elif line == "}":
            current = None
        elif current:
            bodies[current].append(line)
    counts, todo, seen = collections.Counter(), ["ENTRY"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        for line in bodies[name]:
            op = re.search(r" = .*?\s([a-z][a-z0-9-]*)\(", line)
            if not op or op.group(1) in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                continue
            counts[op.group(1)] += 1
            called = re.findall(r"(?:body|condition|branch_computations|to_apply)=\{?([^}]*?)\}?(?=,\s[a-z_]+=|$)",
                                line) if op.group(1) in ("while", "conditional", "call") else []
            todo += [c.strip().lstrip("%") for group in called for c in group.split(",")]
    return counts
