"""Plain-PyTorch implementations of every Wiola component, exactly as SPEC defines
them: the oracle that every kernel is tested against.

Each module of this package (one per op, plus the model's blocks such as ``dsff``) lists its
public functions in ``__all__``; the package exports them all, so a new module is exported
without an edit here."""

import importlib as _importlib
import pkgutil as _pkgutil


def _export_modules() -> list[str]:
    # Import every module first, then bind the names: importing ``.rms_norm`` binds the package
    # attribute ``rms_norm`` to the module, which the function of that name must then replace.
    modules = [_importlib.import_module(f"{__name__}.{m.name}") for m in _pkgutil.iter_modules(__path__)]
    names = []
    for module in modules:
        for name in module.__all__:
            globals()[name] = getattr(module, name)
            names.append(name)
    return sorted(names)


__all__ = _export_modules()
