"""Registered ops (``torch.ops.wiola.*``) and their public Python functions."""
