"""CUDA sources of cgx_ucx's GPU kernels (installed as ``cgx_ucx.kernels``).

Only data lives here: the ``.cu`` files are read by
``cgx_ucx.compression.gpu`` and compiled lazily with NVRTC through CuPy.
"""
