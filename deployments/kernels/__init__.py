"""The decode step's Triton kernels (``ops``, ``triton_jit``) and the policy that decides which
of them a model runs (``policy``).

Importing them never fails and never touches CUDA: without Triton or a GPU every operation
runs its pure-torch reference.
"""
