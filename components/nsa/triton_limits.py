"""Limits of the Triton kernels that a recipe is checked against before anything imports Triton."""

TRITON_MAX_HEAD_DIM = 256  # the kernels' tiles hold a whole head (triton/tile_configs.py sizes them up to this)
