"""reviewer_kernels/pdl.py: the switch for programmatic dependent launch. Off by default; on, it asks only for CUDA
tensors on Hopper or later (the CPU interpreter cannot run the wait). That it changes no bit on a GPU is
tests/backend/models/test_fast_models.py test_cuda_pdl_changes_no_bit."""

from __future__ import annotations

import torch

from reviewer_kernels import pdl


def test_off_by_default_and_never_for_cpu_tensors(monkeypatch):
    x = torch.zeros(2)
    assert pdl.PDL is False and pdl.pdl_kwargs(x) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "PDL", True)
    assert pdl.pdl_kwargs(x) == {"PDL": False, "launch_pdl": False}  # a CPU tensor (the interpreter's) never
