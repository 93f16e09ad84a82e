"""Run by the *system* python (Debian's python3-pyverbs): does every pyverbs name, attribute and
keyword argument that irdmafs/transport/verbs.py uses exist in the real pyverbs?

Prints one line per problem and exits 1 if there is any; prints a summary and exits 0 otherwise.
Only the standard library and pyverbs are imported (the system python has no trio)."""

import ast
import importlib
import sys

SOURCE = sys.argv[1]

# Expressions in verbs.py that hold pyverbs objects, and their classes.
TYPES = {
    "qp": "pyverbs.qp.QP",
    "self.qp": "pyverbs.qp.QP",
    "mr": "pyverbs.mr.MR",
    "wc": "pyverbs.cq.WC",
    "self.device.cq": "pyverbs.cq.CQ",
    "self.cq": "pyverbs.cq.CQ",
    "ctx": "pyverbs.device.Context",
    "self.ctx": "pyverbs.device.Context",
    "self.port_attr": "pyverbs.device.PortAttr",
    "ctx.query_port(port)": "pyverbs.device.PortAttr",
    "ctx.query_device()": "pyverbs.device.DeviceAttr",
    "self.gid": "pyverbs.addr.GID",
    "wr": "pyverbs.wr.SendWR",
    "attr": "pyverbs.qp.QPAttr",
    "dev": "pyverbs.device.Device",
    "d": "pyverbs.device",
    "e": "pyverbs.enums",
}


def resolve(dotted):
    mod, _, name = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(mod), name)


def accepts(cls, keyword):
    """Call the real constructor with the keyword: only "unexpected keyword" means it is not
    taken (docstrings are not reliable: AHAttr documents grh= but takes gr=). Wrong dummy values
    or a missing device fail differently, after the keyword was accepted."""
    try:
        cls(**{keyword: None})
    except TypeError as exc:
        return "unexpected keyword" not in str(exc)
    except Exception:
        return True
    return True


problems, checked = [], 0
tree = ast.parse(open(SOURCE).read())
imported = {}  # local name -> dotted pyverbs path
for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pyverbs"):
        for alias in node.names:
            checked += 1
            try:
                resolve(f"{node.module}.{alias.name}")
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            except (ImportError, AttributeError):
                problems.append(f"from {node.module} import {alias.name}: missing")
    elif isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith("pyverbs"):
                checked += 1
                try:
                    importlib.import_module(alias.name)
                except ImportError:
                    problems.append(f"import {alias.name}: missing")

for node in ast.walk(tree):
    if isinstance(node, ast.Attribute):
        owner = ast.unparse(node.value)
        if owner in TYPES:
            checked += 1
            if not hasattr(resolve(TYPES[owner]), node.attr):
                problems.append(f"line {node.lineno}: {TYPES[owner]} has no attribute {node.attr!r}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported and node.keywords:
        cls = resolve(imported[node.func.id])
        for kw in node.keywords:
            checked += 1
            if not accepts(cls, kw.arg):
                problems.append(f"line {node.lineno}: {imported[node.func.id]}() takes no keyword {kw.arg!r}")

for p in problems:
    print(p)
print(f"verbs API check: {checked} uses checked, {len(problems)} problems")
sys.exit(1 if problems else 0)
