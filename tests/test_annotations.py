"""The public API is fully annotated: every parameter and return type of
every function, class and public method that ``pyg_maxk``,
``pyg_maxk.nn`` and ``pyg_maxk.ops`` export."""
import inspect

import pyg_maxk
import pyg_maxk.nn
import pyg_maxk.ops

MODULES = (pyg_maxk, pyg_maxk.nn, pyg_maxk.ops)


def _public_callables():
    seen = set()
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if not inspect.isclass(obj):
                if callable(obj):
                    yield f"{module.__name__}.{name}", obj
                continue
            for attr, value in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                elif isinstance(value, property):
                    value = value.fget
                if inspect.isfunction(value):
                    yield f"{module.__name__}.{name}.{attr}", value


def _missing_annotations(qualname, fn):
    sig = inspect.signature(fn)
    missing = [f"{qualname}({p})" for p, param in sig.parameters.items()
               if p not in ("self", "cls") and param.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append(f"{qualname} -> ?")
    return missing


def test_public_api_is_annotated():
    callables = list(_public_callables())
    assert len(callables) > 50  # the walk reaches the API
    missing = [m for qualname, fn in callables for m in _missing_annotations(qualname, fn)]
    assert missing == []
