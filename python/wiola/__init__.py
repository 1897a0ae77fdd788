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

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_wiola import PRESETS, WiolaConfig
from .modeling_wiola import WiolaCache, WiolaForCausalLM, WiolaModel

AutoConfig.register("wiola", WiolaConfig, exist_ok=True)
AutoModel.register(WiolaConfig, WiolaModel, exist_ok=True)
AutoModelForCausalLM.register(WiolaConfig, WiolaForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "WiolaCache", "WiolaConfig", "WiolaForCausalLM", "WiolaModel"]
