"""Plain-PyTorch implementations of every Wiola component, exactly as SPEC defines
them: the oracle that every kernel is tested against."""

from .atm import atm_merge, atm_merge_backward, atm_unmerge, atm_unmerge_backward
from .dsff import dsff
from .rms_norm import rms_norm, rms_norm_backward, rms_norm_forward
from .srpe import srpe, srpe_backward, srpe_cos_sin, srpe_frequencies

__all__ = ["atm_merge", "atm_merge_backward", "atm_unmerge", "atm_unmerge_backward",
           "dsff", "rms_norm", "rms_norm_backward", "rms_norm_forward", "srpe", "srpe_backward",
           "srpe_cos_sin", "srpe_frequencies"]
