"""wiola: the reference Wiola decoder (SPEC §2) built on ``wiola_kernels``.

Importing the package registers ``WiolaConfig`` / ``WiolaForCausalLM`` with the Hugging
Face Auto classes under ``model_type="wiola"``::

    import wiola
    from transformers import AutoModelForCausalLM

    model = wiola.WiolaForCausalLM(wiola.WiolaConfig.from_name("wiola-tiny"))
    model.save_pretrained("ckpt")
    model = AutoModelForCausalLM.from_pretrained("ckpt")

``python -m wiola train | generate | bench`` runs the training demo, generation and the
training-step benchmark.
"""

import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

#: The oldest transformers tested (CI runs the model tests on it and on the pinned one); the
#: model uses transformers-5 APIs (config dataclasses, ``transformers.initialization``,
#: cache layers) that 4.x lacks. Releases before 5.2x call the cache ``past_key_values``:
#: ``modeling_wiola.CACHE_KWARG`` bridges the two names.
MIN_TRANSFORMERS = (5, 17)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(f"wiola needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (it uses transformers-5 "
                      f"APIs), found {transformers.__version__}; pip install -U "
                      f"'transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}'")

from .configuration_wiola import PRESETS, WiolaConfig  # noqa: E402
from .modeling_wiola import WiolaCache, WiolaForCausalLM, WiolaModel  # noqa: E402

AutoConfig.register("wiola", WiolaConfig, exist_ok=True)
AutoModel.register(WiolaConfig, WiolaModel, exist_ok=True)
AutoModelForCausalLM.register(WiolaConfig, WiolaForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "WiolaCache", "WiolaConfig", "WiolaForCausalLM", "WiolaModel"]
