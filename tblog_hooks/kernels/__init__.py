"""Fused kernels for a logged step's statistics (``fused.py``, Triton), and the switch that says
where they run."""
