"""Package attributes loaded on first use (PEP 562), for `jaxport`, `jaxport.train` and
`torch_compat`."""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def attach(package: str, names: Mapping[str, tuple[str, str | None]],
           listed: list[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, whose public name -> (module relative to
    it, attribute or None for the module itself) are `names`; `__dir__` lists `listed`.

    A name is imported on first access and then stored in the package, so later lookups skip
    `__getattr__`.
    """
    def __getattr__(name: str) -> Any:
        try:
            module, attr = names[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = importlib.import_module(module, package)
        if attr is not None:
            value = getattr(value, attr)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return list(listed)

    return __getattr__, __dir__
