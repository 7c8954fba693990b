"""What exists only to make a replica start faster: Ray's worker setup hook (``early``), the
bytecode cache (``bytecode``), the CUDA context and Triton's set-up on side threads
(``context``, ``triton_setup``). Each is started and waited
for by the replica's start (``deployments.server.start``); nothing in the engine, the model or
the kernels imports this package.
"""
