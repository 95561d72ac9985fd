"""Reading a plan's `output_spec`: torch's serialized pytree treespec."""
from __future__ import annotations

import importlib
import json

# Packages whose output types register themselves with torch's pytree when
# their module is imported (transformers' ModelOutput classes), so a process
# that reads a plan without having imported them (remat-verify) can.
_SELF_REGISTERING = ("transformers.",)


def load_treespec(text: str):
    """`torch.utils._pytree.treespec_loads(text)`, first importing the module
    of each type it names from a package that registers its types on import."""
    from torch.utils import _pytree as pytree

    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001 - retried below once the types' modules are imported
        imported = False
        for name in _type_names(text):
            if name.startswith(_SELF_REGISTERING) and "." in name:
                try:
                    importlib.import_module(name.rsplit(".", 1)[0])
                    imported = True
                except ImportError:
                    pass
        if not imported:
            raise
    return pytree.treespec_loads(text)


def _type_names(text: str) -> list[str]:
    try:
        data = json.loads(text)
    except ValueError:
        return []
    out: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                out.append(node["type"])
            for child in node.get("children_spec") or []:
                walk(child)

    walk(data[1] if isinstance(data, list) and len(data) == 2 else data)
    return out
