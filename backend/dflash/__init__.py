"""The DFlash drafter: the block-diffusion model (model.py) and its GPU fast path (fast.py)."""
