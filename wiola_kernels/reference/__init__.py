"""Plain-PyTorch implementations of every Wiola component, exactly as SPEC defines
them: the oracle that every kernel is tested against."""

from .add_rms_norm import add_rms_norm, add_rms_norm_backward, add_rms_norm_forward
from .atm import atm_merge, atm_merge_backward, atm_unmerge, atm_unmerge_backward
from .dsff import dsff
from .glu import glu, glu_backward, glu_forward
from .gcla_attention import (gcla_attention, gcla_attention_backward, gcla_attention_forward, gcla_context_kv,
                             gcla_cross_attention, gcla_summary)
from .rms_norm import rms_norm, rms_norm_backward, rms_norm_forward
from .srpe import srpe, srpe_backward, srpe_cos_sin, srpe_frequencies

__all__ = ["add_rms_norm", "add_rms_norm_backward", "add_rms_norm_forward", "atm_merge", "atm_merge_backward",
           "atm_unmerge", "atm_unmerge_backward", "dsff", "gcla_attention", "gcla_attention_backward",
           "gcla_attention_forward", "gcla_context_kv", "gcla_cross_attention", "gcla_summary", "glu",
           "glu_backward", "glu_forward", "rms_norm", "rms_norm_backward", "rms_norm_forward", "srpe",
           "srpe_backward", "srpe_cos_sin", "srpe_frequencies"]
